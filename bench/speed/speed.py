"""How long an estimate and a plan take, for the big catalog models.

    python -m bench speed           # prints the table, writes bench/results/speed-cpu.json
    python -m bench speed --plan    # only the planning rows (bench/results/speed-plan-cpu.json)
    python -m bench speed --ranks   # per-rank FSDP2 estimates (bench/results/speed-ranks-cpu.json)

Each row is the wall time of one ``memfit.estimate`` call in a warm process (imports done),
best of ``REPEATS``. The depth fast path is the default for these; ``full`` rows trace every block.
"""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file
os.environ.setdefault("MEMFIT_DEVICE", "cpu")  # graded by the CPU allocator: CPU semantics (the default is CUDA)
os.environ.setdefault("KINETO_LOG_LEVEL", "6")


import memfit  # noqa: E402
from bench import _results  # noqa: E402

RESULTS = ("speed-cpu.json", "speed-plan-cpu.json", "speed-ranks-cpu.json")
REPEATS = 2
CASES = [  # (model, seq_len, precision, fast)
    ("llama-3.1-8b", 2048, "fp32", True),
    ("llama-3.1-8b", 2048, "bf16-mixed", True),
    ("llama-3.1-70b", 2048, "fp32", True),
    ("llama-3.1-70b", 2048, "bf16-mixed", True),
    ("llama-3.1-8b", 2048, "fp32", False),
]


PLANS = [  # (model, gpu, seq_len, global batch, allow)
    ("llama-3.1-8b", "rtx-4090", 2048, 64, ""),
    ("llama-3.1-8b", "rtx-4090", 2048, 64, "qlora"),
    ("llama-3.1-8b", "h200", 2048, 64, ""),
]


RANKS = [  # (model, gpus, nodes, recipe): one rank's step under the fake process group (FSDP2: the depth fast path)
    ("llama-3.1-8b", 8, 1, {"parallel": "fsdp", "mixed_precision": "bf16:fp32", "checkpointing": "blocks"}),
    ("llama-3.1-8b", 8, 8, {"parallel": "fsdp", "mixed_precision": "bf16:fp32", "checkpointing": "blocks"}),
    ("llama-3.1-70b", 8, 1, {"parallel": "fsdp"}),
    ("llama-3.1-70b", 8, 1, {"parallel": "fsdp", "mixed_precision": "bf16:fp32", "checkpointing": "blocks"}),
    ("llama-3.1-70b", 8, 2, {"parallel": "fsdp", "mixed_precision": "bf16:fp32", "checkpointing": "blocks"}),
]


def ranks() -> None:
    rows = []
    for model, gpus, nodes, recipe in RANKS:
        start = time.perf_counter()
        report = memfit.estimate(model, seq_len=2048, batch_size=gpus * nodes, gpus=gpus, nodes=nodes,
                                 recipe=memfit.Recipe(**recipe))
        seconds = time.perf_counter() - start
        rows.append({"model": model, "gpus": gpus, "nodes": nodes, "recipe": recipe, "seq_len": 2048,
                     "seconds": round(seconds, 1), "peak_bytes": report.peak_bytes, "ranks": len(report.ranks)})
        print(f"{model} {nodes}x{gpus} {recipe}: {seconds:.1f} s, peak {report.peak_bytes / 2**30:.2f} GiB", flush=True)
    _results.write("speed-ranks-cpu.json", rows)


def plans() -> None:
    rows = []
    for model, gpu, seq, gbs, allow in PLANS:  # cold: each call traces afresh (no cache= passed)
        start = time.perf_counter()
        try:
            result = memfit.plan(model, gpu=gpu, seq_len=seq, global_batch_size=gbs, allow=allow)
            seconds = time.perf_counter() - start
            row = {"fits": True, "candidates": result.candidates, "traces": result.settings["traces"],
                   "recipe": result.best.recipe.describe(), "device_bytes": result.best.device_bytes,
                   "tokens_per_second": round(result.best.tokens_per_second)}
        except memfit.NothingFits as err:
            seconds = time.perf_counter() - start
            row = {"fits": False, "message": str(err)}
        rows.append({"model": model, "gpu": gpu, "seq_len": seq, "global_batch_size": gbs, "allow": allow,
                     "seconds": round(seconds, 1), **row})
        print(f"plan {model} on {gpu} allow={allow or '-'}: {seconds:.1f} s  "
              f"{row.get('candidates', '')} candidates  {row.get('recipe', row.get('message', ''))}", flush=True)
    _results.write("speed-plan-cpu.json", rows)


def main() -> None:
    if "--ranks" in sys.argv:
        memfit.estimate("gpt2", seq_len=16)  # warm imports
        return ranks()
    if "--plan" in sys.argv:
        memfit.estimate("gpt2", seq_len=16)  # warm imports
        return plans()
    memfit.estimate("gpt2", seq_len=16)  # warm imports
    rows = []
    for model, seq, precision, fast in CASES:
        best, report = float("inf"), None
        for _ in range(REPEATS):
            start = time.perf_counter()
            report = memfit.estimate(model, seq_len=seq, precision=precision, fast=fast)
            best = min(best, time.perf_counter() - start)
        mode = "depth" if fast else "full"
        rows.append({"model": model, "seq_len": seq, "precision": precision, "mode": mode,
                     "seconds": round(best, 2), "peak_bytes": report.peak_bytes})
        print(f"{model:16} seq {seq} {precision:10} {mode:5} {best:6.2f} s  peak {memfit.format_size(report.peak_bytes)}",
              flush=True)
    _results.write("speed-cpu.json", rows)
    plans()


if __name__ == "__main__":
    main()
