"""memfit.profile() on users' own loops, graded by the CPU allocator; its overhead; the README picture.

    python -m bench profile_loops accuracy   # 7 loops over 6 model families: profile peak vs the allocator's
    python -m bench profile_loops leaks      # 4 leaky loops and 3 clean ones: leaks by line, bytes per step
    python -m bench profile_loops overhead   # step time with and without the profile
    python -m bench profile_loops picture    # docs/pictures/profile-llama.png: a profile with its estimate over it
    python -m bench profile_loops all

Each loop runs in a process of its own (nothing left by another loop in the allocator's count). The
truth is ``memfit.estimator.truth.allocator_steps``: torch.profiler's allocation events, one session
per step, with nobody else watching. Results: bench/results/profile-cpu.json.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]  # the tests' loops; bench/ a package when run as a file
from bench import _results  # noqa: E402
RESULTS = "profile-cpu.json"
TABLES = ("accuracy", "leaks")  # rows; the picture and the overhead are single results: the summary


def _one(kind: str, name: str) -> dict:
    """In this process: one loop profiled and graded."""
    import torch

    import _loops
    from memfit.estimator.truth import allocator_steps
    from memfit.profiling.profile import profile

    table = {**_loops.MODELS, **_loops.LEAKY, **_loops.CLEAN}
    loop = table[name]
    with profile(device="cpu") as prof:
        for _ in loop():
            pass
    truth, nets = allocator_steps(loop())
    report = prof.report
    mine = report.peak_bytes - prof.entry_bytes
    row = {"loop": name, "kind": kind, "profile_peak": mine, "allocator_peak": truth,
           "error_pct": round(100 * (mine - truth) / truth, 4), "steps": prof.steps,
           "by_category": report.by_category, "torch": torch.__version__}
    if kind != "model":
        per_step = statistics.median(nets[1:])
        found = sum(leak["bytes_per_step"] for leak in report.leaks)
        row.update(allocator_bytes_per_step=per_step, leaks=[{k: leak[k] for k in ("site", "bytes_per_step", "steps",
                                                                                   "category")} for leak in report.leaks],
                   found_bytes_per_step=found,
                   forwards_without_backward=len(prof.forwards_without_backward))
        if kind == "leak":
            line = _loops.leak_line(loop)
            row["expected_site"] = f"_loops.py:{line}"
            row["site_right"] = bool(report.leaks) and report.leaks[0]["site"].endswith(row["expected_site"])
            row["bytes_error_pct"] = round(100 * (found - per_step) / per_step, 4) if per_step else None
    return row


def _in_process(kind: str, name: str) -> dict:
    run = subprocess.run([sys.executable, __file__, "_one", kind, name], capture_output=True, text=True)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode or not lines:
        return {"loop": name, "kind": kind, "error": run.stderr.strip().splitlines()[-1:] or ["no output"]}
    return json.loads(lines[-1])


def accuracy() -> list[dict]:
    import _loops

    rows = [_in_process("model", name) for name in _loops.MODELS]
    print(f"{'loop':24} {'profile':>12} {'allocator':>12} {'error':>9}")
    for row in rows:
        print(f"{row['loop']:24} {row.get('profile_peak', 0):>12,} {row.get('allocator_peak', 0):>12,} "
              f"{row.get('error_pct', float('nan')):>8.3f}%")
    return rows


def leaks() -> list[dict]:
    import _loops

    rows = [_in_process("leak", name) for name in _loops.LEAKY] + [_in_process("clean", n) for n in _loops.CLEAN]
    print(f"{'loop':16} {'kind':6} {'leaks found':>30} {'B/step':>10} {'allocator':>10} {'site right':>10}")
    for row in rows:
        sites = ", ".join(leak["site"].rsplit("/", 1)[-1] for leak in row.get("leaks", [])) or "none"
        print(f"{row['loop']:16} {row['kind']:6} {sites:>30} {row.get('found_bytes_per_step', 0):>10,} "
              f"{row.get('allocator_bytes_per_step', 0):>10,.0f} {str(row.get('site_right', '-')):>10}")
    return rows


def _timed_loop(steps: int, watch: bool) -> list[float]:
    import torch

    import _loops
    from memfit.profiling.profile import profile

    torch.manual_seed(0)
    model = _loops._llama(layers=4, hidden=256, vocab=2048)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    block = profile(device="cpu") if watch else None
    if block is not None:
        block.__enter__()
    try:
        for _ in range(steps):
            start = time.perf_counter()
            ids = _loops._tokens(8, 128, vocab=2048)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - start)
    finally:
        if block is not None:
            start = time.perf_counter()
            block.__exit__(None, None, None)
            times.append(time.perf_counter() - start)  # the report, made once at the end
    return times


def overhead() -> dict:
    import torch

    torch.set_num_threads(1)
    steps = 8
    plain, watched = [], []
    for _ in range(2):  # alternated, so drift on a shared machine hits both
        plain.append(_timed_loop(steps, False))
        watched.append(_timed_loop(steps, True))
    step_plain = statistics.median(t for run in plain for t in run[2:])
    step_watched = statistics.median(t for run in watched for t in run[2:steps])
    report_time = statistics.median(run[steps] for run in watched)
    row = {"model": "llama 4 x 256, vocab 2048, batch 8 x 128, AdamW, 1 thread", "steps": steps,
           "step_s_plain": round(step_plain, 4), "step_s_profiled": round(step_watched, 4),
           "overhead_pct": round(100 * (step_watched / step_plain - 1), 1),
           "report_s": round(report_time, 3)}
    print(f"step {step_plain * 1000:.0f} ms plain, {step_watched * 1000:.0f} ms profiled "
          f"({row['overhead_pct']:+.1f} %); the report at the end {report_time:.2f} s")
    return row


def picture() -> dict:
    import torch

    import _loops
    import memfit
    from memfit.profiling.profile import profile
    from memfit.report.pictures import write_html, write_png

    with profile(device="cpu") as prof:
        for _ in _loops.llama_adamw(steps=3):
            pass
    torch.manual_seed(0)
    ids = _loops._tokens(4, 64)
    estimate = memfit.estimate(lambda: _loops._llama(), batch={"input_ids": ids, "labels": ids}, steps=3,
                               loss_fn=lambda model, batch: model(**batch).loss)
    out = ROOT / "docs" / "pictures" / "profile-llama.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    title = "memfit profile: a user's own loop (tiny Llama, AdamW, 3 steps) with memfit's estimate over it"
    write_png(prof.report, out, estimate=estimate, title=title)
    if "--html" in sys.argv:
        write_html(prof.report, out.with_suffix(".html"), estimate=estimate, title=title)
    print(f"wrote {out.relative_to(ROOT)}: profile peak {prof.report.peak_bytes:,} B, estimate {estimate.peak_bytes:,} B")
    return {"png": str(out.relative_to(ROOT)), "profile_peak": prof.report.peak_bytes,
            "estimate_peak": estimate.peak_bytes}


def main() -> None:
    if sys.argv[1] == "_one":
        print(json.dumps(_one(sys.argv[2], sys.argv[3])))
        return
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    old = _results.read(RESULTS) if _results.path(RESULTS).exists() else {"rows": [], "summary": {}}
    results = {**{name: _results.table(old, name) for name in TABLES}, **old["summary"]}  # a part not run keeps its last
    jobs = {"accuracy": accuracy, "leaks": leaks, "overhead": overhead, "picture": picture}
    for name, job in jobs.items():
        if which in (name, "all"):
            results[name] = job()
    _results.write(RESULTS, _results.tables(**{name: results.pop(name) for name in TABLES}), results)


if __name__ == "__main__":
    main()
