"""Every model family: tiny-size error against the CPU allocator, and the time of a full trace of
a 1B-class member.

    python -m bench families            # prints both tables, writes bench/results/families-cpu.json
    python -m bench families --tiny     # only the tiny-size errors

The tiny cases are the configs of ``tests/test_families.py`` (truth: ``memfit.estimator.truth.true_peak``,
the allocator's own events). The timed cases are catalog models estimated with ``fast=False``
(every block traced, as ``memfit estimate NAME --full``), batch 1 at the sequence given below.
The machine's 2 cores may be shared, so process CPU time is recorded beside wall time.
"""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file
os.environ.setdefault("MEMFIT_DEVICE", "cpu")  # graded by the CPU allocator: CPU semantics (the default is CUDA)
sys.path.insert(0, os.path.join(ROOT, "tests"))
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import torch  # noqa: E402

import memfit  # noqa: E402
from memfit.models.source import resolve  # noqa: E402
from memfit.estimator.truth import true_peak  # noqa: E402
from bench import _results  # noqa: E402

RESULTS = "families-cpu.json"

# (catalog name, seq_len): one 1B-class member of each family; seq None = the model's default.
FULL = [("qwen1.5-moe-a2.7b", 2048), ("mixtral-8x7b", 2048), ("mamba-1.4b", 2048), ("mamba2-1.3b", 2048),
        ("whisper-large-v3", None), ("llava-1.5-7b", None)]


def tiny_rows() -> list[dict]:
    import json as _json
    import tempfile

    from test_families import CONFIGS

    rows = []
    for family, config in CONFIGS.items():
        with tempfile.TemporaryDirectory() as folder:
            with open(os.path.join(folder, "config.json"), "w") as f:
                _json.dump(config, f)
            source = resolve(os.path.join(folder, "config.json"))
            for precision in ("fp32", "bf16-mixed"):
                torch.manual_seed(0)
                batch = source.make_batch(2, 32)
                report = memfit.estimate(source.build, batch, precision=precision)
                truth = true_peak(source.build, batch, precision=precision)
                error = (report.peak_bytes - truth) / truth
                rows.append({"case": f"{family}/{precision}", "estimated": report.peak_bytes, "measured": truth,
                             "error": error})
                print(f"{family + '/' + precision:24} {report.peak_bytes:>12,} {truth:>12,} {100 * error:>+8.4f}%",
                      flush=True)
    return rows


def full_rows(names) -> list[dict]:
    rows = []
    for name, seq_len in FULL:
        if names and name not in names:
            continue
        wall, cpu = time.perf_counter(), time.process_time()
        report = memfit.estimate(name, seq_len=seq_len, fast=False, precision="bf16-mixed")
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        seq = seq_len or resolve(name).default_seq_len()
        rows.append({"model": name, "seq_len": seq, "precision": "bf16-mixed", "parameters": report.parameters,
                     "peak_bytes": report.peak_bytes, "peak_gib": round(report.peak_bytes / 2**30, 2),
                     "wall_seconds": round(wall, 1), "cpu_seconds": round(cpu, 1), "method": report.method})
        print(f"{name:20} seq {seq:>5} {report.parameters / 1e9:>7.2f}B {report.peak_bytes / 2**30:>9.2f} GiB "
              f"{wall:>7.1f} s wall {cpu:>7.1f} s cpu", flush=True)
    return rows


def main() -> None:
    args = sys.argv[1:]
    print(f"{'tiny case':24} {'estimated':>12} {'measured':>12} {'error':>9}")
    tiny = tiny_rows() if "--full-only" not in args else []
    full = [] if "--tiny" in args else full_rows([a for a in args if not a.startswith("--")])
    previous = _results.read(RESULTS) if _results.path(RESULTS).exists() else {"rows": [], "summary": {}}
    tiny = tiny or _results.table(previous, "tiny")  # a part not run now keeps its last rows
    full = full or _results.table(previous, "full")
    worst = max(abs(r["error"]) for r in tiny) if tiny else previous["summary"].get("worst_abs_tiny_error")
    _results.write(RESULTS, _results.tables(tiny=tiny, full=full), {"worst_abs_tiny_error": worst})


if __name__ == "__main__":
    main()
