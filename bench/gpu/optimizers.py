"""Optimizer implementations on CUDA: estimates made here (no GPU) against a GPU's allocator.

    python -m bench optimizers estimate          # CPU: CUDA-semantics estimates -> results/optimizers-estimates.json
    python -m bench optimizers measure --out D   # on a GPU: the same steps for real -> D/optimizers-<gpu>.json
    python -m bench optimizers compare           # both files -> error per case
    python -m bench optimizers cpu-speed         # this CPU: foreach / fused / for-loop step times
    python -m bench optimizers roofline          # the planner's optimizer-step seconds per implementation

The cases are torch's AdamW as foreach, fused and for-loop, SGD foreach and fused, bitsandbytes'
8-bit AdamW and torchao's 8-bit, 4-bit and FP8 AdamW, on the Llama-shaped model of
``bench/gpu/cuda_checks.py`` (8 x 1024, vocabulary 32000, batch 8 x 1024, fp32 weights, bf16-mixed).
Each records the peak allocated over two steps, the optimizer step's own extra bytes (peak during
``opt.step()`` above what was allocated before it) and its median time. What it checks: that
fused holds no step temporaries on CUDA as it does in the trace, what the roofline's
foreach/fused ratio is against the GPU's, and whether torchao's Triton kernels allocate what the
CPU's Inductor kernels do (``techniques/_lowbit.py`` models the CPU's), and whether the first step's peak stands
above the second's (Triton's autotuning copies: a cause issue 53 suspects of torchtune's 8-bit AdamW row, 10 % over
memfit). Not yet run on a GPU; ``bench/gpu/lease.sh`` runs it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file

import torch  # noqa: E402
import transformers as tf  # noqa: E402

from memfit import Recipe  # noqa: E402
from bench import _results  # noqa: E402

RESULTS = ("optimizers-estimates.json", "optimizers-<card>.json")
CASES = {
    "adamw foreach": {"optimizer_impl": "foreach"}, "adamw fused": {"optimizer_impl": "fused"},
    "adamw forloop": {"optimizer_impl": "forloop"}, "sgd foreach": {"optimizer": "sgd", "optimizer_impl": "foreach"},
    "sgd fused": {"optimizer": "sgd", "optimizer_impl": "fused"}, "bnb adamw8bit": {"optimizer": "adamw8bit"},
    "ao adamw8bit": {"optimizer": "ao_adamw8bit"}, "ao adamw4bit": {"optimizer": "adamw4bit"},
    "ao adamw fp8": {"optimizer": "ao_adamw_fp8"},
}


def _config():
    return tf.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                          num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048,
                          architectures=["LlamaForCausalLM"])


def _recipe(fields):
    return Recipe(precision="bf16-mixed", **fields)


def estimate_all() -> None:
    import memfit

    rows = {}
    for name, fields in CASES.items():
        start = time.perf_counter()
        r = memfit.estimate(_config(), recipe=_recipe(fields), batch_size=8, seq_len=1024, gpu="h100-sxm")
        rows[name] = {"allocated_peak": r.peak_bytes, "reserved_peak": r.reserved_bytes,
                      "optimizer_phase_peak": r.phase_peaks["optimizer"], "seconds": round(time.perf_counter() - start, 1)}
        print(f"{name:16} {r.peak_bytes / 2**30:7.2f} GiB  optimizer phase {r.phase_peaks['optimizer'] / 2**30:7.2f} GiB",
              flush=True)
    _write("optimizers-estimates.json", {"command": "python -m bench optimizers estimate", "torch": torch.__version__}, rows)


def _measure(fields, batch):
    from memfit.techniques.apply import apply

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = tf.LlamaForCausalLM(_config())
    model, opt, step = apply(model, _recipe(fields))
    step(batch)  # the first step: torch.compile's first call (torchao's step), whose Triton autotuning copies the
    torch.cuda.synchronize()  # buffers a kernel writes (pytorch#129258): kept apart from the steady second step
    first = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(batch)
    torch.cuda.synchronize()
    second = torch.cuda.max_memory_allocated()
    peak = max(first, second)
    extra, seconds, inner = [], [], opt.step

    def timed(*args, **kwargs):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        extra.append(torch.cuda.max_memory_allocated() - before)
        return out

    opt.step = timed
    for _ in range(5):
        step(batch)
    return {"allocated_peak": peak, "first_step_peak": first, "second_step_peak": second,
            "optimizer_step_extra": max(extra),
            "optimizer_step_seconds": sorted(seconds)[len(seconds) // 2]}


def measure_all(out_dir: str) -> None:
    ids = torch.randint(0, 32000, (8, 1024), generator=torch.Generator().manual_seed(0)).cuda()
    batch = {"input_ids": ids, "labels": ids.clone()}
    rows = {}
    for name, fields in CASES.items():
        try:
            rows[name] = _measure(fields, batch)
        except Exception as err:  # recorded, not fatal: a missing library must not lose the rest
            rows[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:240]}"}
        print(name, rows[name], flush=True)
    device = torch.cuda.get_device_name()
    tag = "h100" if "H100" in device else device.replace(" ", "-").lower()
    _write(f"optimizers-{tag}.json", {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda,
                                      "command": "python -m bench optimizers measure"}, rows, out_dir)


def compare() -> None:
    est = _results.by_name(_results.read(RESULTS[0])["rows"])
    for path in sorted(f.name for f in _results.DIR.glob("optimizers-*.json") if f.name != RESULTS[0]):
        real = _results.by_name(_results.read(path)["rows"])
        for name, row in real.items():
            if "error" in row or name not in est:
                continue
            error = est[name]["allocated_peak"] / row["allocated_peak"] - 1
            print(f"{path:24} {name:16} allocated {error:+.2%}  step extra {row['optimizer_step_extra'] / 2**20:8.1f} MiB")


def cpu_speed() -> None:
    """Median of 7 steps over 16 1024 x 1024 weights and 16 vectors (16.8M values), real tensors."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(1024, 1024)) for _ in range(16)]
    params += [torch.nn.Parameter(torch.randn(1024)) for _ in range(16)]
    for p in params:
        p.grad = torch.randn_like(p)
    makers = {"adamw": lambda kw: torch.optim.AdamW(params, **kw),
              "sgd": lambda kw: torch.optim.SGD(params, lr=1e-3, momentum=0.9, **kw)}
    for name, make in makers.items():
        times = {}
        for impl, kw in (("foreach", {"foreach": True}), ("fused", {"fused": True}), ("forloop", {"foreach": False})):
            opt = make(kw)
            opt.step()
            runs = []
            for _ in range(7):
                start = time.perf_counter()
                opt.step()
                runs.append(time.perf_counter() - start)
            times[impl] = sorted(runs)[3]
        print(name, {k: f"{v * 1e3:.1f} ms" for k, v in times.items()},
              f"foreach/fused {times['foreach'] / times['fused']:.2f}")


def roofline(model: str = "llama-3.2-1b") -> None:
    """The planner's optimizer terms (``planner/terms.py``) of ``model`` per implementation: the
    roofline's step seconds on an H100 and on this CPU, and the optimizer phase's peak."""
    from memfit.estimator.fake_trace import fake_trace
    from memfit.hardware.gpus import gpu
    from memfit.models.source import resolve
    from memfit.planner.cost import Speed
    from memfit.planner.terms import optimizer_terms

    source = resolve(model)
    for target in (gpu("h100-sxm"), None):
        speed = Speed.from_gpu(target) if target else Speed.host()
        seconds = {}
        for impl in ("foreach", "fused", "forloop"):
            result = fake_trace(source, None, recipe=Recipe(optimizer_impl=impl), loss_fn=None, optimizer=None,
                                steps=2, batch_size=1, seq_len=32, gpu=target, detail=True)
            terms = optimizer_terms(result, None, speed)
            seconds[impl] = terms.optimizer_seconds
            print(f"{model} {speed.name:10} {impl:8} {terms.optimizer_seconds * 1e3:9.2f} ms  optimizer phase "
                  f"{terms.optimizer / 2**30:6.2f} GiB")
        print(f"{model} {speed.name}: foreach/fused {seconds['foreach'] / seconds['fused']:.2f}")


def _write(name, meta, rows, out_dir=str(_results.DIR)) -> None:
    _results.write(os.path.join(out_dir, name), _results.named(rows), **meta,
                   model="Llama-shaped 8 x 1024, vocab 32000, batch 8 x 1024, bf16-mixed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("estimate", "measure", "compare", "cpu-speed", "roofline"))
    parser.add_argument("--out", default=str(_results.DIR))
    args = parser.parse_args()
    {"estimate": estimate_all, "measure": lambda: measure_all(args.out), "compare": compare, "cpu-speed": cpu_speed,
     "roofline": roofline}[args.what]()


if __name__ == "__main__":
    main()
