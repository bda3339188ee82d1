"""How long an estimate takes, for the big catalog models.

    python bench/speed.py           # prints the table, writes bench/results/speed-cpu.json

Each row is the wall time of one ``memfit.estimate`` call in a warm process (imports done),
best of ``REPEATS``. The depth fast path is the default for these; ``full`` rows trace every block.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import torch  # noqa: E402

import memfit  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "speed-cpu.json")
REPEATS = 2
CASES = [  # (model, seq_len, precision, fast)
    ("llama-3.1-8b", 2048, "fp32", True),
    ("llama-3.1-8b", 2048, "bf16-mixed", True),
    ("llama-3.1-70b", 2048, "fp32", True),
    ("llama-3.1-70b", 2048, "bf16-mixed", True),
    ("llama-3.1-8b", 2048, "fp32", False),
]


def main() -> None:
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
    meta = {"torch": torch.__version__, "cores": os.cpu_count(), "date": datetime.date.today().isoformat(),
            "command": "python bench/speed.py"}
    with open(OUT, "w") as f:
        json.dump({"meta": meta, "cases": rows}, f, indent=1)


if __name__ == "__main__":
    main()
