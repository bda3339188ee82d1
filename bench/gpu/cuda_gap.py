"""How far a CPU-semantics estimate is from what CUDA allocates, case by case.

Two halves, so the estimate is made without a GPU:

    python -m bench cuda_gap estimate            # here, on CPU: writes bench/results/cuda-gap-estimates.json
    python -m bench cuda_gap measure --out DIR   # on the GPU: real steps, max_memory_allocated/reserved

``measure`` reads the estimates, runs the same cases on CUDA (same models, batches, losses,
optimizers, precisions, 2 steps), and writes ``cuda-gap-<device>.json`` with estimated and
measured bytes per case, plus ``cuda-traces-<device>.json.gz``: the caching allocator's own
alloc/free sequence of every case (``torch.cuda.memory._record_memory_history``), kept for
modelling CUDA semantics later. The gap is reported, not tuned for: the estimate follows CPU
semantics (CPU SDPA kernels, CPU autocast lists, single-tensor optimizers, no 512-byte rounding).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file

import torch  # noqa: E402

from memfit.models.zoo import CASES  # noqa: E402
from bench import _results  # noqa: E402

RESULTS = ("cuda-gap-estimates.json", "cuda-gap-<card>.json")  # and cuda-traces-<card>.json.gz: every event
ESTIMATES = RESULTS[0]
ZOO = [(name, prec, opt) for name in CASES for prec in ("fp32", "bf16-mixed") for opt in ("adamw", "sgd")]
# (catalog name, batch size, sequence length or None, precision)
CATALOG = [
    ("gpt2", 4, 1024, "fp32"), ("gpt2", 4, 1024, "bf16-mixed"),
    ("bert-base", 8, 512, "fp32"), ("bert-base", 8, 512, "bf16-mixed"),
    ("vit-base", 32, None, "fp32"), ("vit-base", 32, None, "bf16-mixed"),
    ("t5-small", 8, 512, "bf16-mixed"),
    ("qwen2.5-0.5b", 2, 2048, "bf16-mixed"),
    ("llama-3.2-1b", 1, 2048, "fp32"), ("llama-3.2-1b", 1, 2048, "bf16-mixed"),
]


def _key(*parts) -> str:
    return "/".join(str(p) for p in parts)


def estimate_all() -> None:
    import memfit

    out = {}
    for name, prec, opt in ZOO:
        factory, batch, loss = CASES[name]
        r = memfit.estimate(factory, batch(), loss_fn=loss, optimizer=opt, precision=prec)
        out[_key(name, prec, opt)] = {"peak": r.peak_bytes, "by_category": r.by_category}
        print(f"{_key(name, prec, opt):32} {memfit.format_size(r.peak_bytes):>12}", flush=True)
    for name, bs, seq, prec in CATALOG:
        r = memfit.estimate(name, batch_size=bs, seq_len=seq, precision=prec)
        out[_key(name, bs, seq, prec)] = {"peak": r.peak_bytes, "by_category": r.by_category}
        print(f"{_key(name, bs, seq, prec):32} {memfit.format_size(r.peak_bytes):>12}", flush=True)
    _results.write(ESTIMATES, _results.named(out))


def _to_cuda(batch):
    if isinstance(batch, torch.Tensor):
        return batch.cuda()
    if isinstance(batch, dict):
        return {k: _to_cuda(v) for k, v in batch.items()}
    return type(batch)(_to_cuda(v) for v in batch)


def _run(build, batch, loss, opt, prec):
    from memfit.techniques.apply import run_steps
    from memfit.techniques.recipe import Recipe

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build()
    batch = _to_cuda(batch)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=2_000_000)
    start = time.perf_counter()
    run_steps(model, batch, recipe=Recipe(precision=prec, optimizer=opt), steps=2, loss_fn=loss)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    stats = torch.cuda.memory_stats()
    trace = [[e["action"], e["size"]] for e in snap["device_traces"][0]]
    del model, batch
    return {
        "allocated_peak": stats["allocated_bytes.all.peak"],
        "reserved_peak": stats["reserved_bytes.all.peak"],
        "requested_peak": stats["requested_bytes.all.peak"],
        "alloc_retries": stats["num_alloc_retries"],
        "seconds_two_steps": round(seconds, 4),
    }, trace


def measure_all(out_dir: str) -> None:
    from memfit.models.source import resolve
    from memfit.units import format_size

    estimates = _results.read(ESTIMATES)
    estimated = _results.by_name(estimates["rows"])
    device = torch.cuda.get_device_name().replace(" ", "-").lower()
    rows, traces = {}, {}
    cases = [(_key(n, p, o), CASES[n][0], CASES[n][1](), CASES[n][2], o, p) for n, p, o in ZOO]
    for name, bs, seq, prec in CATALOG:
        source = resolve(name)
        cases.append((_key(name, bs, seq, prec), source.build, source.make_batch(bs, seq), None, "adamw", prec))
    for key, build, batch, loss, opt, prec in cases:
        try:
            measured, trace = _run(build, batch, loss, opt, prec)
        except Exception as err:  # a case that fails on this GPU is recorded, not fatal
            rows[key] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
            print(key, "ERROR", rows[key]["error"], flush=True)
            continue
        est = estimated[key]["peak"]
        measured["estimated"] = est
        measured["error_vs_allocated"] = round((est - measured["allocated_peak"]) / measured["allocated_peak"], 5)
        rows[key], traces[key] = measured, trace
        print(f"{key:34} est {format_size(est):>11} alloc {format_size(measured['allocated_peak']):>11} "
              f"reserved {format_size(measured['reserved_peak']):>11} err {100 * measured['error_vs_allocated']:+.2f}%",
              flush=True)
    tag = "h100" if "h100" in device else device
    meta = {"cuda": torch.version.cuda, "estimates_from": estimates["meta"]}
    _results.write(os.path.join(out_dir, f"cuda-gap-{tag}.json"), _results.named(rows), **meta)
    with gzip.open(os.path.join(out_dir, f"cuda-traces-{tag}.json.gz"), "wt") as f:  # not a table: every event
        json.dump({"meta": _results.meta(**meta), "traces": traces}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=("estimate", "measure"))
    parser.add_argument("--out", default=str(_results.DIR))
    args = parser.parse_args()
    estimate_all() if args.stage == "estimate" else measure_all(args.out)


if __name__ == "__main__":
    main()
