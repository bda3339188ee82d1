"""memfit's CUDA answers, made on this machine's CPU, against what its GPU really allocates.

    python -m bench gpu_check --out DIR            # on a machine with one CUDA GPU: DIR/gpu-check-<card>.json
    python -m bench gpu_check --smoke              # here, without a GPU: every case's plumbing on tiny models

Each case runs twice, at the same time: its **truth** on the GPU (a fresh process per case, so each
starts with an empty caching allocator; torch's own ``max_memory_allocated`` / ``max_memory_reserved``,
``torch.cuda.host_memory_stats`` and the process's RSS for CPU offload, ``cudaMemGetInfo`` and NVML (what
nvidia-smi shows) for what the process holds outside the allocator), and its **estimate** in a process that sees no GPU
(``CUDA_VISIBLE_DEVICES=""``), through memfit's public API under CUDA semantics for the card found. The
cases: training recipes (fp32, bf16-mixed, pure bf16, fp16 with a scaler, checkpointing, accumulation,
fused and foreach AdamW, LoRA, a mixture of experts, a convolutional net), a whole-model and a per-layer
``torch.compile``, FSDP2 at world size 1 over NCCL under ``torchrun`` with and without
``CPUOffloadPolicy``, DeepSpeed's ZeRO-2 and ZeRO-3 the same way (with ``memfit[deepspeed]`` installed), two generate runs, a profiled user loop with a leak (``memfit.profile``'s peak
against the allocator's) and a real out-of-memory error under ``set_per_process_memory_fraction``
(the estimate's verdict against it), and two published torchtune rows' own steps (``published-*``: the row's
restated model, loss and recipe from ``bench/published/published.py``). Without a GPU the script says so and exits 0.

``--traces`` also writes each named case's allocator trace (``torch.cuda.memory._record_memory_history``:
action, size, stream) to ``DIR/trace-CASE.json.gz``, to find where an estimate and the GPU part, and for
the compile cases what each compiled graph's forward saves for backward, on the GPU and in the estimate
(``DIR/saved-CASE-truth.json``, ``DIR/saved-CASE-estimate.json``: name, op, shape, dtype, bytes).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import gzip
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file
SRC = os.path.join(ROOT, "src")
from bench import _results  # noqa: E402

# gpu-check-<card>.json: estimates against truths; -truths.json: a GPU session's truths alone (for regrade)
RESULTS = "gpu-check-<card>*.json"

GiB = 2 ** 30

# name -> case. kind: train | fsdp | generate | profile | oom. model: a catalog name, or (name, config
# overrides). The smoke run replaces every model by a 2-layer one of the same family.
CASES = {
    "llama1b-fp32": dict(kind="train", model="llama-3.2-1b", bs=1, seq=1024, recipe={}),
    "llama1b-bf16-mixed": dict(kind="train", model="llama-3.2-1b", bs=2, seq=2048,
                               recipe={"precision": "bf16-mixed"}),
    "qwen06b-bf16": dict(kind="train", model="qwen3-0.6b", bs=4, seq=1024, recipe={"precision": "bf16"}),
    "qwen06b-fp16-scaler": dict(kind="train", model="qwen3-0.6b", bs=4, seq=1024,
                                recipe={"precision": "fp16-mixed"}),
    "llama1b-ckpt": dict(kind="train", model="llama-3.2-1b", bs=4, seq=2048,
                         recipe={"precision": "bf16-mixed", "checkpointing": "blocks"}),
    "qwen06b-accum4": dict(kind="train", model="qwen3-0.6b", bs=8, seq=1024,
                           recipe={"precision": "bf16-mixed", "grad_accum_steps": 4}),
    "llama1b-fused": dict(kind="train", model="llama-3.2-1b", bs=2, seq=1024,
                          recipe={"precision": "bf16-mixed", "optimizer_impl": "fused"}),
    "llama1b-foreach": dict(kind="train", model="llama-3.2-1b", bs=2, seq=1024,
                            recipe={"precision": "bf16-mixed", "optimizer_impl": "foreach"}),
    "llama3b-lora": dict(kind="train", model="llama-3.2-3b", bs=2, seq=2048,
                         recipe={"precision": "bf16-mixed", "lora": "lora:16"}),
    "qwen3moe-4l": dict(kind="train", model=("qwen3-30b-a3b", {"num_hidden_layers": 4}), bs=2, seq=1024,
                        recipe={"precision": "bf16-mixed"}),
    "cnn-fp32": dict(kind="train", model="zoo:cnn", bs=None, seq=None, recipe={}),
    # ViT-L/16: its patch embedding is a 16x16 stride-16 convolution, whose cuDNN workspaces (issue 37) are
    # modelled from bench/gpu/cuda_outside.py's measurements; these runs check them inside a whole step
    "vit-large-fp32-b8": dict(kind="train", model="vit-large", bs=8, seq=None, recipe={}),
    "vit-large-bf16-b32": dict(kind="train", model="vit-large", bs=32, seq=None, recipe={"precision": "bf16-mixed"}),
    "qwen06b-compile": dict(kind="train", model="qwen3-0.6b", bs=4, seq=1024,
                            recipe={"precision": "bf16-mixed", "compile": True}),
    "qwen06b-compile-layers": dict(kind="train", model="qwen3-0.6b", bs=4, seq=1024,
                                   recipe={"precision": "bf16-mixed", "compile": "layers"}),
    "fsdp-llama1b": dict(kind="fsdp", model="llama-3.2-1b", bs=2, seq=2048,
                         recipe={"parallel": "fsdp", "mixed_precision": "bf16"}),
    "fsdp-offload-llama3b": dict(kind="fsdp", model="llama-3.2-3b", bs=2, seq=2048,
                                 recipe={"parallel": "fsdp", "mixed_precision": "bf16", "offload": "cpu"}),
    # DeepSpeed ZeRO at world size 1 (issue 51): the engine's own buffers on a real GPU (needs memfit[deepspeed])
    "zero2-llama1b": dict(kind="fsdp", model="llama-3.2-1b", bs=2, seq=2048,
                          recipe={"parallel": "zero2", "precision": "bf16", "zero": "reduce_bucket_size=5e7"}),
    "zero3-llama1b": dict(kind="fsdp", model="llama-3.2-1b", bs=2, seq=2048,
                          recipe={"parallel": "zero3", "precision": "bf16"}),
    # ZeRO-Offload: the host's partitions found by DeepSpeed's attribute names (techniques/deepspeed_offload.py)
    "zero2-offload-llama1b": dict(kind="fsdp", model="llama-3.2-1b", bs=2, seq=2048,
                                  recipe={"parallel": "zero2", "precision": "bf16",
                                          "zero": "reduce_bucket_size=5e7,offload_optimizer=cpu"}),
    "generate-llama1b": dict(kind="generate", model="llama-3.2-1b", bs=8, prompt=1024, new=256),
    # the same loaded as users load it (from_pretrained of saved random bf16 weights onto the card): the built model's
    # reserved bytes were 5.2 % above the estimate's on the H200 (2026-11-26), all of it before the generation began
    "generate-llama1b-loaded": dict(kind="generate", model="llama-3.2-1b", bs=8, prompt=1024, new=256, load=True),
    "generate-qwen8b": dict(kind="generate", model="qwen3-8b", bs=4, prompt=4096, new=64),
    "profile-leak": dict(kind="profile", model="llama-3.2-1b", bs=2, seq=1024, recipe={}),
    "oom-llama1b-fp32": dict(kind="oom", model="llama-3.2-1b", bs=8, seq=2048, recipe={}, budget=24 * GiB),
    # two published torchtune rows' steps as bench/published estimates them (torchtune's restated decoder, its chunked
    # compiled loss; recipe from the row), run on the card: is their excess over the published peak (+3 %, +6 %)
    # memfit's or the restated step's? (issue 53). The smoke run puts them on two tiny layers.
    "published-tt-3b-lora": dict(kind="train", model="published:tt-3b-lora", bs=None, seq=None, recipe={}),
    "published-tt-8b-lora": dict(kind="train", model="published:tt-8b-lora-4090", bs=None, seq=None, recipe={}),
    # the 3B QLoRA row (+6.9 %, its stated settings' floor 4.58 GiB under the published 4.6): does the card's compiled
    # chunked loss write its first gradient chunk beside the 8 saved logit chunks, as the CPU's Inductor does?
    # torchao's NF4 from the carried SITE
    "published-tt-3b-qlora": dict(kind="train", model="published:tt-3b-qlora", bs=None, seq=None, recipe={}),
}
# cases whose allocator trace --traces keeps
TRACED = ("generate-llama1b", "generate-llama1b-loaded", "qwen06b-compile", "qwen06b-compile-layers", "fsdp-offload-llama3b", "profile-leak")


# -- models and batches ------------------------------------------------------------------------------
def _recipe(case: dict, smoke: bool) -> dict:
    """The case's Recipe fields: a published row's own (``bench/published/published.py``) or the case's."""
    if isinstance(case["model"], str) and case["model"].startswith("published:"):
        from bench.published.published import row_step

        return row_step(case["model"].partition(":")[2], smoke)[3]
    return case["recipe"]


def _source(spec, smoke: bool):
    from memfit.models.source import resolve

    if isinstance(spec, str) and spec.startswith("published:"):
        from bench.published.published import row_step

        build, batch, loss, _ = row_step(spec.partition(":")[2], smoke)
        return None, build, batch, loss
    if spec == "zoo:cnn":
        from memfit.models.zoo import CASES as ZOO

        build, batch, loss = ZOO["cnn"]
        return None, build, batch, loss
    name, overrides = (spec, {}) if isinstance(spec, str) else spec
    config = resolve(name).config
    config = type(config).from_dict(config.to_dict())
    for key, value in overrides.items():
        setattr(config, key, value)
    if smoke:
        source = resolve(config).shallow(2)
        config = source.config
        for key, value in dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, vocab_size=512, num_experts=4,
                               num_experts_per_tok=2).items():
            if hasattr(config, key):
                setattr(config, key, value)
    return config, None, None, None


def _shape(case: dict, smoke: bool) -> tuple:
    if not smoke:
        return case.get("bs"), case.get("seq")
    rows = 2 * case.get("recipe", {}).get("grad_accum_steps", 1)
    return (None if case.get("bs") is None else rows), (None if case.get("seq") is None else 32)


# -- estimates (no GPU) -------------------------------------------------------------------------------
def estimate_case(name: str, card: str, smoke: bool, saved: str | None = None) -> dict:
    import memfit

    case = CASES[name]
    config, build, make_batch, loss = _source(case["model"], smoke)
    device = "cpu" if smoke else "cuda"
    gpu = None if smoke else card
    bs, seq = _shape(case, smoke)
    start = time.perf_counter()
    if case["kind"] == "generate":
        prompt, new = (16, 4) if smoke else (case["prompt"], case["new"])
        import inspect

        if "gpu" not in inspect.signature(memfit.estimate_generate).parameters:
            gpu, device = {}, "cpu"  # a memfit from before generate had CUDA semantics
        else:
            gpu = {} if smoke else {"gpu": gpu}
        r = memfit.estimate_generate(config, prompt_len=prompt, new_tokens=new, batch_size=case["bs"] if not smoke
                                     else 2, precision="bf16", device=device, **gpu)
    elif case["kind"] == "profile":
        return {}
    else:
        recipe = memfit.Recipe(**_recipe(case, smoke))
        model = config if config is not None else build
        batch = make_batch() if make_batch is not None else None
        extra = {"gpus": 1} if case["kind"] == "fsdp" else {}
        budget = case.get("budget") if not smoke else None
        with _saved_log(os.path.join(saved, f"saved-{name}-estimate.json") if saved and "compile" in case["recipe"]
                        else None):
            r = memfit.estimate(model, batch, loss_fn=loss, recipe=recipe, batch_size=bs, seq_len=seq, device=device,
                                gpu=gpu, budget=budget, **extra)
    return {"allocated": r.peak_bytes, "reserved": r.reserved_bytes, "device_bytes": r.device_bytes,
            "context_bytes": r.context_bytes, "host_bytes": r.host_bytes, "pinned_bytes": r.pinned_bytes,
            "verdict": r.verdict, "seconds": round(time.perf_counter() - start, 1)}


@contextlib.contextmanager
def _saved_log(path: str | None):
    """Writes what each compiled graph's forward saves for backward (AOTAutograd's partition, as Inductor asks
    for it) to ``path``: name, producing op, shape, dtype. The same on the GPU's truth and the CPU's estimate,
    so a compile case's error is read tensor by tensor (``--traces``)."""
    if path is None:
        yield
        return
    import torch._inductor.compile_fx as compile_fx

    made, graphs = compile_fx.min_cut_rematerialization_partition, []

    def logged(joint, joint_inputs, **kwargs):
        fw, bw = made(joint, joint_inputs, **kwargs)
        ops = {n.name: str(n.target) for n in fw.graph.nodes}
        saved = []
        for node in bw.graph.nodes:
            val = node.meta.get("val") if node.op == "placeholder" else None
            if val is not None and hasattr(val, "shape") and not node.name.startswith("tangents"):
                saved.append([node.name, ops.get(node.name, "?"), list(val.shape), str(val.dtype),
                              val.numel() * val.element_size()])
        graphs.append({"saved": saved, "bytes": sum(s[-1] for s in saved)})
        return fw, bw

    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    caches = inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache
    # a cached graph skips the partition: compile anew
    inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache = False, False
    compile_fx.min_cut_rematerialization_partition = logged
    try:
        yield
    finally:
        compile_fx.min_cut_rematerialization_partition = made
        inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache = caches
        with open(path, "w") as f:
            json.dump(graphs, f)


# -- truths (on the GPU) ------------------------------------------------------------------------------
def _to(batch, device):
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(v, device) for v in batch)
    return batch


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _nvml_process() -> int | None:
    """What nvidia-smi shows for this process (NVML's used memory for its pid); None where NVML cannot say."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        return next((p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                     if p.pid == os.getpid()), None)
    except Exception:  # noqa: BLE001 - a diagnostic, never the case's result
        return None


def _stats(dev) -> dict:
    import torch

    if dev.type != "cuda":
        return {}
    torch.cuda.synchronize()
    s = torch.cuda.memory_stats()
    free, total = torch.cuda.mem_get_info()
    out = {"allocated": s["allocated_bytes.all.peak"], "reserved": s["reserved_bytes.all.peak"],
           "active": s["active_bytes.all.peak"], "retries": s.get("num_alloc_retries", 0),
           "device_allocs": s.get("num_device_alloc", 0),
           "large_pool_reserved": s.get("reserved_bytes.large_pool.peak", 0),
           "small_pool_reserved": s.get("reserved_bytes.small_pool.peak", 0),
           "reserved_now": s["reserved_bytes.all.current"],
           "outside_allocator_now": total - free - s["reserved_bytes.all.current"],
           "nvml_process_now": _nvml_process(),
           "host_rss": _rss(), "host_rss_peak": _hwm()}
    host = getattr(torch.cuda, "host_memory_stats", None)
    if host is not None:
        try:
            h = host()
            out["pinned_host"] = {k: v for k, v in h.items() if k.startswith(("allocated_bytes", "reserved_bytes",
                                                                                 "allocations", "segment"))
                                  and k.endswith((".peak", ".current", "peak", "current"))}
        except Exception as err:  # noqa: BLE001 - a diagnostic, never the case's result
            out["pinned_host"] = repr(err)
    return out


def _record(name: str, dev, traces: bool) -> None:
    import torch

    if traces and dev.type == "cuda" and name in TRACED:
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=1_500_000)


def _dump_trace(name: str, dev, traces: bool, out: str | None) -> None:
    import torch

    if not (traces and dev.type == "cuda" and name in TRACED and out):
        return
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    codes = {"alloc": 0, "free_requested": 1, "free_completed": 2, "segment_alloc": 3, "segment_free": 4,
             "segment_map": 5, "segment_unmap": 6, "oom": 7, "snapshot": 8}
    events = [[codes.get(e["action"], 9), e["size"], e.get("stream", 0)] for e in snap["device_traces"][0]]
    with gzip.open(os.path.join(out, f"trace-{name}.json.gz"), "wt") as f:
        json.dump(events, f)


def truth_case(name: str, smoke: bool, traces: bool = False, out: str | None = None, saved: bool = False) -> dict:
    import torch

    case = CASES[name]
    dev = torch.device("cpu" if smoke else "cuda")
    config, build, make_batch, loss = _source(case["model"], smoke)
    bs, seq = _shape(case, smoke)
    if dev.type == "cuda":
        torch.cuda.init()
        torch.empty(1, device=dev)
        free, total = torch.cuda.mem_get_info()
        context = total - free
    torch.manual_seed(0)
    kind = case["kind"]
    if kind == "generate":
        return _truth_generate(case, config, dev, smoke, name, traces, out) | ({"context_at_init": context}
                                                                            if dev.type == "cuda" else {})
    if kind == "profile":
        return _truth_profile(config, dev, bs, seq, name, traces, out)
    if kind == "fsdp":
        return _truth_fsdp(case, config, dev, bs, seq, name, traces, out)
    from memfit import Recipe
    from memfit.models.source import resolve
    from memfit.techniques.apply import run_steps

    recipe = Recipe(**_recipe(case, smoke))
    if config is not None:
        source = resolve(config)
        build, batch = source.build, source.make_batch(bs or 1, seq)
    else:
        batch = make_batch()
    if kind == "oom" and dev.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(case["budget"] / torch.cuda.get_device_properties(0).total_memory)
    _record(name, dev, traces)
    with torch.device(dev):
        model = build()
    try:
        with _saved_log(os.path.join(out, f"saved-{name}-truth.json") if saved and out and "compile" in case["recipe"]
                        else None):
            run_steps(model, _to(batch, dev), recipe=recipe, steps=2, loss_fn=loss)
        oom = False
    except torch.OutOfMemoryError:
        oom = True
    _dump_trace(name, dev, traces, out)
    return _stats(dev) | {"oom": oom} | ({"context_at_init": context} if dev.type == "cuda" else {})


def _truth_generate(case, config, dev, smoke, name, traces, out) -> dict:
    import torch

    from memfit.generation.generate import check_request
    from memfit.generation.run import prompt_batch, run_generate
    from memfit.models.source import resolve

    prompt_len, new = (16, 4) if smoke else (case["prompt"], case["new"])
    request = check_request(prompt_len, new, 2 if smoke else case["bs"], "dynamic", False, None)
    # built in bf16 where it runs, as from_pretrained(dtype=torch.bfloat16) loads it: no fp32 copy to cast
    # (whose freed blocks would leave the cache fragmented before the generation starts)
    if case.get("load"):  # as users load it: saved on the host, then from_pretrained onto the device
        import tempfile

        from transformers import AutoModelForCausalLM

        folder = tempfile.mkdtemp()
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map=str(dev))
    else:
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(dev):
                model = resolve(config).build()
        finally:
            torch.set_default_dtype(default)
    prompt = _to(prompt_batch(request, config.vocab_size), dev)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    _record(name, dev, traces)
    ids = run_generate(model, prompt, request)
    _dump_trace(name, dev, traces, out)
    assert ids.shape[1] == prompt_len + new, ids.shape
    return _stats(dev)


def _truth_profile(config, dev, bs, seq, name, traces, out) -> dict:
    """A user's own loop (no memfit inside but the profile block) that keeps every step's logits: a leak."""
    import torch

    import memfit
    from memfit.models.source import resolve

    source = resolve(config)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with memfit.profile(device=dev.type, record_history=False) as prof:
        with torch.device(dev):
            model = source.build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        kept = []
        for step in range(4):
            ids = torch.randint(0, config.vocab_size, (bs, seq), device=dev)
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                out_ = model(input_ids=ids, labels=ids)
            out_.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            kept.append(out_.logits[:, -8:].detach().clone())  # leak: kept across steps
    report = prof.report
    stats = _stats(dev)
    stats["memfit_profile_peak"] = report.peak_bytes
    stats["memfit_profile_reserved"] = report.reserved_bytes
    stats["leaks"] = [{k: leak[k] for k in ("site", "bytes_per_step") if k in leak} for leak in report.leaks or []]
    return stats


def _truth_fsdp(case, config, dev, bs, seq, name, traces, out) -> dict:
    """One rank of ``torchrun --nproc_per_node 1`` (NCCL): built on the host, sharded onto the GPU by
    memfit's apply (FSDP2, or DeepSpeed's engine for a ZeRO recipe), two steps."""
    import torch
    import torch.distributed as dist

    from memfit import Recipe
    from memfit.models.source import resolve
    from memfit.techniques.apply import run_steps

    if dev.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    try:
        recipe = Recipe(**case["recipe"]) if dev.type == "cuda" else Recipe(**case["recipe"]).replace(offload="none")
        source = resolve(config)
        rss_before = _rss()
        model = source.build()  # on the host, as simple scripts build it
        batch = _to(source.make_batch(bs, seq), dev)
        rss_model = _rss()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        _record(name, dev, traces)
        run_steps(model, batch, recipe=recipe, steps=2)
        _dump_trace(name, dev, traces, out)
        return _stats(dev) | {"host_rss_before_model": rss_before, "host_rss_after_model": rss_model}
    finally:
        dist.destroy_process_group()


# -- the driver ---------------------------------------------------------------------------------------
def _run(args: list[str], env: dict | None = None, timeout: float = 300) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines or not lines[-1].startswith("{"):
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:400]
        return {"error": f"exit {proc.returncode}: {tail}"}
    return json.loads(lines[-1])


def _truth_args(name: str, smoke: bool, traces: bool, out: str) -> list[str]:
    flags = ["one-truth", name, "--out", out] + (["--smoke"] if smoke else []) + (["--traces"] if traces else [])
    if CASES[name]["kind"] == "fsdp":
        return ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                os.path.abspath(__file__), *flags]
    return flags


def _truth_proc(name: str, smoke: bool, traces: bool, out: str) -> dict:
    args = _truth_args(name, smoke, traces, out)
    if args[0] == "-m":
        proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)
        lines = [line for line in proc.stdout.strip().splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:  # the rank's own error, not torchrun's summary after it
            errors = [line for line in proc.stderr.splitlines() if "Error: " in line] or proc.stderr.splitlines()
            return {"error": f"exit {proc.returncode}: {(errors or ['?'])[0][:400]}"}
        return json.loads(lines[-1])
    return _run(args)


def _error(est, real) -> float | None:
    if est is None or not real:
        return None
    return round((est - real) / real, 5)


def _row(name: str, est: dict, real: dict) -> dict:
    row = {"kind": CASES[name]["kind"], "estimated": est, "measured": real}
    if "error" in est or "error" in real or "allocated" not in real:
        return row
    if CASES[name]["kind"] == "profile":
        row["error_allocated"] = _error(real["memfit_profile_peak"], real["allocated"])
        row["error_reserved"] = _error(real["memfit_profile_reserved"], real["reserved"])
    elif CASES[name]["kind"] == "oom":
        row["verdict_right"] = (est.get("verdict") == "out_of_memory") == real["oom"]
    else:
        row["error_allocated"] = _error(est["allocated"], real["allocated"])
        row["error_reserved"] = _error(est["reserved"], real["reserved"])
    if real.get("outside_allocator_now") is not None and est.get("device_bytes") and CASES[name]["kind"] not in ("profile", "oom"):
        # what nvidia-smi's device line shows at the peak: the allocator's reserved peak (it keeps its segments)
        # plus what the process holds outside it (cudaMemGetInfo's used - reserved, read after the run)
        row["device_truth"] = real["reserved"] + real["outside_allocator_now"]
        row["error_device"] = _error(est["device_bytes"], row["device_truth"])
        row["error_outside"] = _error(est["device_bytes"] - est["reserved"], real["outside_allocator_now"])
    return row


def _summary(rows: dict) -> dict:
    alloc = [abs(r["error_allocated"]) for r in rows.values() if r.get("error_allocated") is not None]
    res = [abs(r["error_reserved"]) for r in rows.values() if r.get("error_reserved") is not None]
    failed = sorted(n for n, r in rows.items() if "error" in r["estimated"] or "error" in r["measured"])
    out = {"cases": len(rows), "failed": failed,
           "verdicts_right": sum(bool(r.get("verdict_right")) for r in rows.values()),
           "verdicts": sum("verdict_right" in r for r in rows.values())}
    if alloc:
        out |= {"allocated_median_abs": statistics.median(alloc), "allocated_max_abs": max(alloc)}
    if res:
        out |= {"reserved_median_abs": statistics.median(res), "reserved_max_abs": max(res)}
    for key in ("device", "outside"):
        errors = [abs(r[f"error_{key}"]) for r in rows.values() if r.get(f"error_{key}") is not None]
        if errors:
            out |= {f"{key}_median_abs": statistics.median(errors), f"{key}_max_abs": max(errors)}
    return out


def _card() -> tuple[str, str]:
    import torch

    from memfit.errors import MemfitError
    from memfit.hardware.gpus import gpu

    name = torch.cuda.get_device_name()
    try:
        return name, gpu(name).name
    except MemfitError:
        return name, "h100-sxm"


def check(out: str, names: list[str], smoke: bool, traces: bool, workers: int) -> dict:
    import torch

    os.makedirs(out, exist_ok=True)
    device, card = ("cpu (smoke)", "cpu") if smoke else _card()
    started = time.perf_counter()
    blind = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "2"}
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        # slow estimates (compile, the 8B generate) first, so they overlap the GPU's runs
        order = sorted(names, key=lambda n: ("compile" not in n and "qwen8b" not in n, n))
        futures = {n: pool.submit(_run, ["one-estimate", n, "--gpu", card] + (["--smoke"] if smoke else [])
                                  + (["--traces", "--out", out] if traces else []), blind, 900) for n in order}
        truths = {}
        for n in names:
            t0 = time.perf_counter()
            try:
                truths[n] = _truth_proc(n, smoke, traces, out)
            except subprocess.TimeoutExpired:
                truths[n] = {"error": "timed out"}
            except Exception as err:  # noqa: BLE001 - one case's failure is recorded, the rest still run
                truths[n] = {"error": f"{type(err).__name__}: {err}"[:400]}
            truths[n]["seconds"] = round(time.perf_counter() - t0, 1)
            _results.write(os.path.join(out, "truths-partial.json"), _results.named(truths))  # if cut short
            print(f"truth {n:26} {json.dumps({k: truths[n].get(k) for k in ('allocated', 'reserved', 'oom', 'error')})}",
                  flush=True)
        rows = {}
        for n in names:
            try:
                est = futures[n].result()
            except subprocess.TimeoutExpired:
                est = {"error": "timed out"}
            rows[n] = _row(n, est, truths[n])
            a, r = rows[n].get("error_allocated"), rows[n].get("error_reserved")
            print(f"{n:26} allocated {'-' if a is None else f'{100 * a:+.2f}%':>8}  reserved "
                  f"{'-' if r is None else f'{100 * r:+.2f}%':>8}  {rows[n].get('verdict_right', '')}"
                  f"{est.get('error', '')}{truths[n].get('error', '')}", flush=True)
    summary = _summary(rows)
    path = _results.write(os.path.join(out, f"gpu-check-{card}.json"), _results.named(rows), summary,
                          device=device, card=card, cuda=torch.version.cuda,
                          seconds=round(time.perf_counter() - started, 1),
                          estimated_on="the same machine's CPU (CUDA_VISIBLE_DEVICES=''), concurrently")
    print(json.dumps(summary, indent=1))
    print("wrote", path)
    return summary


def regrade(truths_path: str, out: str, workers: int, only: str | None) -> dict:
    """Estimates made here (this CPU, this torch) graded against a GPU session's recorded truths: how the
    estimate's changes since that session fare without a GPU. Writes ``gpu-check-<card>.json``."""
    recorded = _results.read(truths_path)
    truths = _results.by_name(recorded["rows"])
    card = recorded["meta"]["card"]
    names = [n for n in CASES if n in truths and (not only or n in only.split(","))]
    with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
        futures = {n: pool.submit(_run, ["one-estimate", n, "--gpu", card], {"CUDA_VISIBLE_DEVICES": ""}, 1800)
                   for n in names}
        rows = {}
        for n in names:
            rows[n] = _row(n, futures[n].result(), truths[n])
            a, r = rows[n].get("error_allocated"), rows[n].get("error_reserved")
            print(f"{n:26} allocated {'-' if a is None else f'{100 * a:+.2f}%':>8}  reserved "
                  f"{'-' if r is None else f'{100 * r:+.2f}%':>8}  {rows[n].get('verdict_right', '')}", flush=True)
    import torch
    import transformers

    meta = dict(recorded["meta"], estimated_on=f"this repository's CPU machine, torch {torch.__version__}, "
                f"transformers {transformers.__version__}", regraded=datetime.date.today().isoformat())
    meta.pop("command")  # this run's, not the truths' session's
    summary = _summary(rows)
    path = _results.write(os.path.join(out, f"gpu-check-{card}.json"), _results.named(rows), summary, **meta)
    print(json.dumps(summary, indent=1))
    print("wrote", path)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", nargs="?", default="check", choices=("check", "one-truth", "one-estimate", "regrade"))
    parser.add_argument("case", nargs="?")
    parser.add_argument("--out", default=str(_results.DIR))
    parser.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    parser.add_argument("--gpu", default="h100-sxm", help="(one-estimate) the catalog card")
    parser.add_argument("--smoke", action="store_true", help="tiny models, CPU truth: the plumbing without a GPU")
    parser.add_argument("--traces", action="store_true", help=f"allocator traces of {', '.join(TRACED)}; what each compiled graph saves for "
                        "backward (saved-CASE-truth.json / -estimate.json)")
    parser.add_argument("--truths", default=str(_results.path("gpu-check-h200-truths.json")),
                        help="(regrade) a GPU run's recorded truths")
    parser.add_argument("--workers", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)))
    args = parser.parse_args()
    if args.stage == "one-truth":
        print(json.dumps(truth_case(args.case, args.smoke, args.traces, args.out, saved=args.traces)))
        return
    if args.stage == "one-estimate":
        print(json.dumps(estimate_case(args.case, args.gpu, args.smoke, args.out if args.traces else None)))
        return
    if args.stage == "regrade":
        regrade(args.truths, args.out, args.workers, args.cases)
        return
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU visible to torch: skipped (run it on a machine with one, or --smoke)")
        return
    names = list(CASES) if not args.cases else [n.strip() for n in args.cases.split(",")]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}: the cases are {', '.join(CASES)}")
    check(args.out, names, args.smoke, args.traces, args.workers)


if __name__ == "__main__":
    main()
