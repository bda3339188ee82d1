"""CUDA-semantics estimates, made without a GPU, against what a GPU allocates and reserves.

    python -m bench gpu_accuracy estimate             # here, CPU only: bench/results/gpu-accuracy-estimates.json
    python -m bench gpu_accuracy measure --out DIR    # on the GPU: each case in a fresh process
    python -m bench gpu_accuracy compare              # estimates vs the H100 runs in cuda-gap-h100.json

``estimate`` calls ``memfit.estimate(..., device="cuda", gpu=GPU)`` for every case on the CPU.
``measure`` runs the same cases for real on the GPU (same models, batches, losses, optimizers,
recipes, 2 steps), one subprocess per case so each starts with an empty caching allocator, reads
``max_memory_allocated`` / ``max_memory_reserved`` (``torch.cuda.memory_stats``) and writes
``gpu-accuracy-<device>.json`` with device, torch version, date and the error of each case.
``compare`` grades the estimates against an earlier GPU session's measurements of the plain-recipe
cases (``cuda-gap-h100.json``: H100, torch 2.11, those cases run one after another in one process,
``empty_cache`` between them) and writes ``gpu-accuracy-h100.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file

import torch  # noqa: E402
from bench import _results  # noqa: E402

RESULTS = ("gpu-accuracy-estimates.json", "gpu-accuracy-<card>.json")
ESTIMATES = RESULTS[0]
GPU = os.environ.get("MEMFIT_GPU", "h100-sxm")

ZOO = [(name, prec, opt) for name in ("mlp", "cnn", "lstm", "encoder", "gpt", "hf-llama", "hf-gpt2", "hf-bert")
       for prec in ("fp32", "bf16-mixed") for opt in ("adamw", "sgd")]
# (catalog name, batch size, sequence length or None, recipe fields)
CATALOG = [
    ("gpt2", 4, 1024, {"precision": "fp32"}), ("gpt2", 4, 1024, {"precision": "bf16-mixed"}),
    ("bert-base", 8, 512, {"precision": "fp32"}), ("bert-base", 8, 512, {"precision": "bf16-mixed"}),
    ("vit-base", 32, None, {"precision": "fp32"}), ("vit-base", 32, None, {"precision": "bf16-mixed"}),
    ("t5-small", 8, 512, {"precision": "bf16-mixed"}),
    ("qwen2.5-0.5b", 2, 2048, {"precision": "bf16-mixed"}),
    ("llama-3.2-1b", 1, 2048, {"precision": "fp32"}), ("llama-3.2-1b", 1, 2048, {"precision": "bf16-mixed"}),
    # techniques: not in cuda-gap-h100.json, measured only by `measure`
    ("llama-3.2-1b", 2, 2048, {"precision": "bf16-mixed", "checkpointing": "blocks"}),
    ("llama-3.2-1b", 2, 2048, {"precision": "bf16-mixed", "optimizer": "adamw8bit"}),
    ("gpt2", 8, 1024, {"precision": "bf16-mixed", "checkpointing": "blocks", "chunked_loss": 4}),
]


def _key(*parts) -> str:
    return "/".join(str(p) for p in parts if p != {})


def _catalog_key(name, bs, seq, fields) -> str:
    extra = ",".join(f"{k}={v}" for k, v in fields.items() if k != "precision")
    return _key(name, bs, seq, fields["precision"]) + (f"/{extra}" if extra else "")


def cases():
    """(key, build, make_batch, loss_fn, Recipe) for every case, nothing built yet."""
    from memfit.models.source import resolve
    from memfit.models.zoo import CASES
    from memfit.techniques.recipe import Recipe

    for name, prec, opt in ZOO:
        build, batch, loss = CASES[name]
        yield _key(name, prec, opt), build, batch, loss, Recipe(precision=prec, optimizer=opt)
    for name, bs, seq, fields in CATALOG:
        source = resolve(name)
        yield (_catalog_key(name, bs, seq, fields), source.build,
               (lambda s=source, b=bs, q=seq: s.make_batch(b, q)), None, Recipe(**fields))


def estimate_all() -> None:
    import memfit

    out = {}
    for key, build, batch, loss, recipe in cases():
        start = time.perf_counter()
        r = memfit.estimate(build, batch(), loss_fn=loss, recipe=recipe, device="cuda", gpu=GPU, fast=False)
        out[key] = {"allocated": r.peak_bytes, "reserved": r.reserved_bytes, "device_bytes": r.device_bytes,
                    "seconds": round(time.perf_counter() - start, 2)}
        print(f"{key:56} alloc {memfit.format_size(r.peak_bytes):>11} reserved "
              f"{memfit.format_size(r.reserved_bytes):>11}  {out[key]['seconds']:.1f}s", flush=True)
    _results.write(ESTIMATES, _results.named(out), gpu_semantics=GPU)


def measure_one(key: str) -> None:
    """Run one case on the GPU in this (fresh) process; print its allocator stats as JSON."""
    from bench.gpu.cuda_gap import _to_cuda

    from memfit.techniques.apply import run_steps

    _, build, batch, loss, recipe = next(c for c in cases() if c[0] == key)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build()
    data = _to_cuda(batch())
    torch.cuda.synchronize()
    start = time.perf_counter()
    run_steps(model, data, recipe=recipe, steps=2, loss_fn=loss)
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    print(json.dumps({"allocated": stats["allocated_bytes.all.peak"], "reserved": stats["reserved_bytes.all.peak"],
                      "seconds_two_steps": round(time.perf_counter() - start, 3)}))


def _errors(est: dict, real: dict) -> dict:
    return {"error_allocated": round((est["allocated"] - real["allocated"]) / real["allocated"], 5),
            "error_reserved": round((est["reserved"] - real["reserved"]) / real["reserved"], 5)}


def _summary(rows: dict) -> dict:
    ok = [r for r in rows.values() if "error_allocated" in r]
    if not ok:
        return {}
    alloc = [abs(r["error_allocated"]) for r in ok]
    res = [abs(r["error_reserved"]) for r in ok]
    return {"cases": len(ok), "allocated_median_abs": statistics.median(alloc), "allocated_max_abs": max(alloc),
            "reserved_median_abs": statistics.median(res), "reserved_max_abs": max(res)}


def _write(name: str, meta: dict, rows: dict, out_dir: str = str(_results.DIR)) -> None:
    summary = _summary(rows)
    _results.write(os.path.join(out_dir, name), _results.named(rows), summary, **meta)
    print(json.dumps(summary, indent=1))


def _row(key, est, real) -> dict:
    row = {"estimated": est, "measured": real, **_errors(est, real)}
    print(f"{key:56} alloc {100 * row['error_allocated']:+7.2f}%  reserved {100 * row['error_reserved']:+7.2f}%")
    return row


def measure_all(out_dir: str) -> None:
    estimates = _results.read(ESTIMATES)
    estimated = _results.by_name(estimates["rows"])
    rows = {}
    for key, *_ in cases():
        proc = subprocess.run([sys.executable, __file__, "one", key], capture_output=True, text=True)
        if proc.returncode != 0:
            rows[key] = {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
            print(key, "ERROR", rows[key]["error"], flush=True)
            continue
        rows[key] = _row(key, estimated[key], json.loads(proc.stdout.strip().splitlines()[-1]))
    device = torch.cuda.get_device_name()
    meta = {"cuda": torch.version.cuda, "estimates_from": estimates["meta"]}
    tag = device.lower().replace("nvidia ", "").split()[0]
    _write(f"gpu-accuracy-{tag}.json", meta, rows, out_dir)


# Cases whose recorded run ran library code other than what is installed here, as the traces show.
NOTES = {
    "t5-small/8/512/bf16-mixed": (
        "The recorded run's self-attention took SDPA's math path (fp32 S x S scores, softmax and dropout "
        "output, bool dropout mask: 168 allocations of 64 MiB, none of the mask's .contiguous() copy) because "
        "its transformers passed T5's permuted position bias (stride(-1) = heads) as the mask, and the fused "
        "kernels need stride 1. The transformers installed here makes the mask contiguous "
        "(create_position_bias_mask), so CUDA's rules pick the memory-efficient kernel and the estimate is "
        "lower. With the mask passed as permuted, the estimate is within 0.1% (allocated) of the run."),
}


def compare_existing() -> None:
    estimates = _results.read(ESTIMATES)
    estimated = _results.by_name(estimates["rows"])
    measured = _results.read("cuda-gap-h100.json")
    rows = {}
    for key, real in _results.by_name(measured["rows"]).items():
        if "allocated_peak" not in real or key not in estimated:
            continue
        rows[key] = _row(key, estimated[key],
                         {"allocated": real["allocated_peak"], "reserved": real["reserved_peak"]})
        if key in NOTES:
            rows[key]["note"] = NOTES[key]
    meta = {"device": measured["meta"]["device"], "torch": measured["meta"]["torch"],
            "measured": measured["meta"]["date"], "estimates_from": estimates["meta"],
            "source": "bench/results/cuda-gap-h100.json (plain-recipe cases run in one process)"}
    _write("gpu-accuracy-h100.json", meta, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=("estimate", "measure", "compare", "one"))
    parser.add_argument("key", nargs="?")
    parser.add_argument("--out", default=str(_results.DIR))
    args = parser.parse_args()
    if args.stage == "estimate":
        estimate_all()
    elif args.stage == "measure":
        measure_all(args.out)
    elif args.stage == "compare":
        compare_existing()
    else:
        measure_one(args.key)


if __name__ == "__main__":
    main()
