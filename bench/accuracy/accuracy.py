"""Estimate vs the CPU allocator's own events, case by case.

    python -m bench accuracy        # prints the table, writes bench/results/accuracy-cpu.json

Truth is ``torch.profiler`` with ``profile_memory=True`` on a real run of the same steps with
nobody watching (``memfit.estimator.truth.true_peak``); the estimate runs on fake tensors.
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
from memfit.models.zoo import CASES  # noqa: E402
from memfit.estimator.truth import true_peak  # noqa: E402
from bench import _results  # noqa: E402

RESULTS = "accuracy-cpu.json"


def main() -> None:
    rows = []
    print(f"{'case':32} {'estimated':>12} {'measured':>12} {'error':>9} {'est. s':>7}")
    for name in CASES:
        factory, make_batch, loss_fn = CASES[name]
        for precision in ("fp32", "bf16-mixed", "fp16-mixed"):
            for optimizer in ("adamw", "sgd"):
                if name == "lstm" and precision == "fp16-mixed":
                    continue  # oneDNN has no fp16 LSTM on CPU: the real run fails too
                batch = make_batch()
                start = time.perf_counter()
                report = memfit.estimate(factory, batch, loss_fn=loss_fn, optimizer=optimizer, precision=precision)
                seconds = time.perf_counter() - start
                truth = true_peak(factory, batch, loss_fn=loss_fn, optimizer=optimizer, precision=precision)
                error = (report.peak_bytes - truth) / truth
                case = f"{name}/{precision}/{optimizer}"
                rows.append({"case": case, "estimated": report.peak_bytes, "measured": truth,
                             "error": error, "modelled_scratch": report.modelled_bytes,
                             "estimate_seconds": round(seconds, 3)})
                print(f"{case:32} {report.peak_bytes:>12,} {truth:>12,} {100 * error:>+8.4f}% {seconds:>7.2f}",
                      flush=True)
    worst = max(abs(r["error"]) for r in rows)
    exact = sum(r["estimated"] == r["measured"] for r in rows)
    print(f"{len(rows)} cases, worst |error| {100 * worst:.4f}%, byte-exact {exact}/{len(rows)}")
    _results.write(RESULTS, rows, {"worst_abs_error": worst, "byte_exact": exact})


if __name__ == "__main__":
    main()
