"""The verdict at the edge: memfit's fits / fits-only-with-expandable-segments / out-of-memory against
what torch does when a step is capped just above or below what it needs.

    python -m bench edge estimate                # here, CPU only: bench/results/edge-estimates.json
    python -m bench edge measure --out DIR       # on the GPU: every run in a fresh process
    python -m bench edge one KEY ALLOWED         # one run (what ``measure`` spawns; env sets the allocator)

``estimate`` traces each case once on the whole card (``gpu_accuracy.py``'s cases, CUDA semantics of
``MEMFIT_GPU``, default h100-sxm), takes its estimated reserved peak R, and for each offset d in
``OFFSETS`` asks memfit for the verdict with the allocator capped at A = R x (1 + d), rounded down to
2 MiB: ``memfit.estimate(..., budget=A + context)``, which replays the allocator as
``torch.cuda.set_per_process_memory_fraction`` enforces a limit of A. 8 cases x 6 offsets = 48 runs.

``measure`` runs every (case, A) for real in a fresh process with
``set_per_process_memory_fraction((A + 1 KiB) / total_memory)`` (torch floors fraction x total; the
extra KiB keeps the limit at A for 2 MiB-multiple segments), two training steps, and records whether it
raised ``torch.cuda.OutOfMemoryError``, ``max_memory_reserved`` and ``num_alloc_retries``. A run that
ran out is run again, fresh, with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``. Then each
verdict is graded: "fits" is right when the default run completes; "fits_with_expandable_segments" when
the default run runs out and the expandable one completes; "out_of_memory" when both run out. It writes
``edge-<gpu>.json``: every run, the confusion matrix, and how often memfit and torch agreed on retries.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file

import torch  # noqa: E402
from bench import _results  # noqa: E402

RESULTS = ("edge-estimates.json", "edge-<card>.json")
ESTIMATES = RESULTS[0]
GPU = os.environ.get("MEMFIT_GPU", "h100-sxm")
MiB = 1 << 20
OFFSETS = (-0.15, -0.06, -0.02, 0.0, 0.02, 0.06)
KEYS = ("gpt2/4/1024/fp32", "gpt2/4/1024/bf16-mixed", "bert-base/8/512/fp32", "bert-base/8/512/bf16-mixed",
        "vit-base/32/None/fp32", "vit-base/32/None/bf16-mixed", "qwen2.5-0.5b/2/2048/bf16-mixed",
        "llama-3.2-1b/1/2048/bf16-mixed")


def _case(key):
    from bench.gpu.gpu_accuracy import cases

    return next(c for c in cases() if c[0] == key)


def estimate_all(only=None) -> None:
    import memfit
    from memfit.hardware.gpus import gpu

    card = gpu(GPU)
    runs = []
    for key in KEYS if only is None else [only]:
        _, build, batch, loss, recipe = _case(key)
        whole = memfit.estimate(build, batch(), loss_fn=loss, recipe=recipe, gpu=card, fast=False)
        for offset in OFFSETS:
            allowed = int(whole.reserved_bytes * (1 + offset)) // (2 * MiB) * (2 * MiB)
            start = time.perf_counter()
            r = memfit.estimate(build, batch(), loss_fn=loss, recipe=recipe, gpu=card, fast=False,
                                budget=allowed + card.cuda_context_bytes)
            runs.append({"key": key, "offset": offset, "allowed": allowed, "verdict": r.verdict,
                         "reserved": r.reserved_bytes, "allocated": r.peak_bytes, "retries": r.retries,
                         "missing": r.missing_bytes, "tight": r.tight, "whole_card_reserved": whole.reserved_bytes,
                         "seconds": round(time.perf_counter() - start, 2)})
            print(f"{key:34} {offset:+.2f} {memfit.format_size(allowed):>11} {r.verdict:30} retries {r.retries}",
                  flush=True)
    _results.write(ESTIMATES, runs, gpu_semantics=GPU, offsets=OFFSETS)


def measure_one(key: str, allowed: int) -> None:
    """One capped run in this fresh process; prints JSON (the allocator's stats, and oom)."""
    from bench.gpu.cuda_gap import _to_cuda

    from memfit.techniques.apply import run_steps

    _, build, batch, loss, recipe = _case(key)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, (allowed + 1024) / total))
    torch.manual_seed(0)
    oom = False
    try:
        with torch.device("cuda"):
            model = build()
        run_steps(model, _to_cuda(batch()), recipe=recipe, steps=2, loss_fn=loss)
        torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError:
        oom = True
    stats = torch.cuda.memory_stats()
    print(json.dumps({"oom": oom, "reserved": stats["reserved_bytes.all.peak"],
                      "allocated": stats["allocated_bytes.all.peak"], "retries": stats["num_alloc_retries"],
                      "device_frees": stats.get("num_device_free", 0), "total_memory": total}))


def _run(key, allowed, expandable=False) -> dict:
    env = dict(os.environ)
    if expandable:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    proc = subprocess.run([sys.executable, __file__, "one", key, str(allowed)], capture_output=True, text=True,
                          env=env)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _actual(default: dict, expandable: dict | None) -> str | None:
    if "error" in default or (expandable is not None and "error" in expandable):
        return None
    if not default["oom"]:
        return "fits"
    return "fits_with_expandable_segments" if not expandable["oom"] else "out_of_memory"


def measure_all(out_dir: str) -> None:
    estimates = _results.read(ESTIMATES)
    rows, confusion, retries_agree = [], {}, 0
    for run in estimates["rows"]:
        default = _run(run["key"], run["allowed"])
        expandable = _run(run["key"], run["allowed"], True) if default.get("oom") else None
        actual = _actual(default, expandable)
        rows.append({**run, "measured_default": default, "measured_expandable": expandable, "actual": actual})
        pair = f"{run['verdict']} -> {actual}"
        confusion[pair] = confusion.get(pair, 0) + 1
        if actual == "fits" and run["verdict"] == "fits":
            retries_agree += bool(run["retries"]) == bool(default["retries"])
        print(f"{run['key']:34} {run['offset']:+.2f} predicted {run['verdict']:30} actual {actual}", flush=True)
    graded = [r for r in rows if r["actual"] is not None]
    summary = {"runs": len(rows), "graded": len(graded),
               "verdict_agrees": sum(r["verdict"] == r["actual"] for r in graded),
               "confusion": confusion, "retries_agree_where_both_fit": retries_agree}
    device = torch.cuda.get_device_name()
    tag = device.lower().replace("nvidia ", "").split()[0]
    _results.write(os.path.join(out_dir, f"edge-{tag}.json"), rows, summary, cuda=torch.version.cuda,
                   estimates_from=estimates["meta"])
    print(json.dumps(summary, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=("estimate", "measure", "one"))
    parser.add_argument("key", nargs="?")
    parser.add_argument("allowed", nargs="?", type=int)
    parser.add_argument("--out", default=str(_results.DIR))
    parser.add_argument("--only", default=None, help="estimate: one case key only")
    args = parser.parse_args()
    if args.stage == "estimate":
        estimate_all(args.only)
    elif args.stage == "measure":
        measure_all(args.out)
    else:
        measure_one(args.key, args.allowed)


if __name__ == "__main__":
    main()
