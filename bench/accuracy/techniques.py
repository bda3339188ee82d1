"""Each technique added on top of the previous: a cumulative table in the style of torchtune's.

    python -m bench techniques                 # CPU: writes bench/results/techniques-cpu.json
    python -m bench techniques --device cuda   # GPU: writes bench/results/techniques-cuda.json

Rows are recipes, each the previous one plus one technique (the effective batch never changes).
Columns on CPU: the estimate at the full size (fake tensors), the estimate and the allocator's
measured peak at a size a 2-core machine can run, and the step time relative to the first row.
On CUDA: the CPU-semantics estimate at the full size (computed here, on the CPU), the measured
``max_memory_allocated`` / ``max_memory_reserved`` at that size, and tokens per second.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file
os.environ.setdefault("MEMFIT_DEVICE", "cpu")  # graded by the CPU allocator: CPU semantics (the default is CUDA)
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import torch  # noqa: E402

import memfit  # noqa: E402
from memfit import Recipe  # noqa: E402
from memfit.techniques.apply import apply  # noqa: E402
from memfit.models.source import resolve  # noqa: E402
from memfit.estimator.truth import true_peak  # noqa: E402
from bench import _results  # noqa: E402

RESULTS = ("techniques-cpu.json", "techniques-cuda.json")

# model -> (source for the full size, full (batch, seq), CPU-feasible source, CPU (batch, seq))
# ("name@N" is the model with N blocks: same widths and vocabulary, so activations dominate as
# they do at full size, on a machine with 2 cores and 24 GiB.)
MODELS = {
    "gpt2-medium": ("gpt2-medium", (8, 1024), "gpt2-medium@2", (2, 256)),
    "llama-3.2-1b": ("llama-3.2-1b", (4, 2048), "llama-3.2-1b@1", (2, 128)),
}


def steps_for(batch: int) -> list[tuple[str, Recipe]]:
    """The cumulative rows; accumulation halves the micro-batch and keeps the effective batch."""
    rows, r = [], Recipe()
    rows.append(("fp32 AdamW", r))
    for label, change in [("+ bf16-mixed", {"precision": "bf16-mixed"}),
                          ("+ sdpa attention", {"attention": "sdpa"}),
                          ("+ checkpointing (blocks)", {"checkpointing": "blocks"}),
                          ("+ chunked loss (8)", {"chunked_loss": 8}),
                          ("+ offload activations", {"offload_activations": True}),
                          ("+ optimizer in backward", {"optimizer_in_backward": True})]:
        r = r.replace(**change)
        rows.append((label, r))
    if batch >= 2:
        rows.append(("- in backward, + accumulation x2", r.replace(optimizer_in_backward=False, grad_accum_steps=2)))
    return rows


def _source(name: str):
    base, _, layers = name.partition("@")
    source = resolve(base)
    return source.shallow(int(layers)) if layers else source


def _to(batch, device):
    return {k: v.to(device) for k, v in batch.items()}


def _time_steps(source, batch, recipe, device, steps=2) -> float:
    """Seconds of the last of ``steps`` steps (the first ones warm up)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = source.build()
    _, _, step = apply(model, recipe)
    for i in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step(batch)
        if device == "cuda":
            torch.cuda.synchronize()
        last = time.perf_counter() - start
    del model, step
    return last


def run_cpu() -> dict:
    out = {}
    for name, (full, (fb, fs), small, (sb, ss)) in MODELS.items():
        source = _source(small)
        batch = source.make_batch(sb, ss)
        rows, base_time = [], None
        print(f"\n{name}: estimate at b{fb} x {fs}; measured at {small} b{sb} x {ss}")
        print(f"{'recipe':34} {'est. full':>11} {'est. small':>11} {'measured':>11} {'err':>7} {'time':>6}  peak in")
        for label, recipe in steps_for(sb):
            est_full = memfit.estimate(full, batch_size=fb, seq_len=fs, recipe=recipe).peak_bytes
            small_report = memfit.estimate(source.build, batch, recipe=recipe)
            est_small = small_report.peak_bytes
            peak_phase = max(small_report.phase_peaks, key=small_report.phase_peaks.get)
            measured = true_peak(source.build, batch, recipe=recipe)
            seconds = _time_steps(source, batch, recipe, "cpu")
            base_time = base_time or seconds
            row = {"recipe": label, "fields": recipe.to_dict(), "estimated_full": est_full,
                   "estimated_small": est_small, "measured_small": measured,
                   "error": (est_small - measured) / measured, "peak_phase": peak_phase,
                   "step_seconds": round(seconds, 3),
                   "time_ratio": round(seconds / base_time, 3)}
            rows.append(row)
            print(f"{label:34} {memfit.format_size(est_full):>11} {memfit.format_size(est_small):>11} "
                  f"{memfit.format_size(measured):>11} {100 * row['error']:>+6.2f}% {row['time_ratio']:>5.2f}x  {peak_phase}",
                  flush=True)
        out[name] = {"full": [fb, fs], "small": [small, sb, ss], "rows": rows}
    return out


def _cuda_row(name: str, index: int) -> dict:
    """One row on the GPU, in this (fresh) process; an OOM is a result, not a failure."""
    full, (fb, fs), _small, _ = MODELS[name]
    label, recipe = steps_for(fb)[index]
    source = _source(full)
    batch = _to(source.make_batch(fb, fs), "cuda")
    torch.cuda.reset_peak_memory_stats()
    try:
        seconds = _time_steps(source, batch, recipe, "cuda")
    except torch.cuda.OutOfMemoryError as err:
        return {"recipe": label, "fields": recipe.to_dict(), "oom": True, "message": str(err).splitlines()[0][:160]}
    stats = torch.cuda.memory_stats()
    return {"recipe": label, "fields": recipe.to_dict(), "allocated_peak": stats["allocated_bytes.all.peak"],
            "reserved_peak": stats["reserved_bytes.all.peak"], "step_seconds": round(seconds, 4),
            "tokens_per_second": round(fb * fs / seconds)}


def run_cuda(estimates: dict, only: str | None = None) -> dict:
    """Each row in its own process: memory an OOM leaves behind cannot spoil the next row."""
    import subprocess

    out = {}
    for name, (full, (fb, fs), _small, _) in MODELS.items():
        if only and name != only:
            continue
        rows = []
        print(f"\n{name}: b{fb} x {fs} on {torch.cuda.get_device_name()}")
        for index, est in enumerate(estimates[name]["rows"]):
            proc = subprocess.run([sys.executable, __file__, "--device", "cuda", "--row", name, str(index)],
                                  capture_output=True, text=True)
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            row["estimated_full_cpu_semantics"] = est["estimated_full"]
            rows.append(row)
            if row.get("oom"):
                print(f"{row['recipe']:34} est {memfit.format_size(est['estimated_full']):>11}  OOM", flush=True)
                continue
            print(f"{row['recipe']:34} est {memfit.format_size(est['estimated_full']):>11} "
                  f"alloc {memfit.format_size(row['allocated_peak']):>11} "
                  f"reserved {memfit.format_size(row['reserved_peak']):>11} {row['tokens_per_second']:>8} tok/s",
                  flush=True)
        out[name] = {"full": [fb, fs], "rows": rows}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", default=str(_results.DIR))
    parser.add_argument("--only", default=None, help="run one model of the table")
    parser.add_argument("--row", nargs=2, default=None, help=argparse.SUPPRESS)  # MODEL INDEX, internal
    args = parser.parse_args()
    if args.row:
        print(json.dumps(_cuda_row(args.row[0], int(args.row[1]))))
        return
    extra = {}
    if args.device == "cpu":
        results = run_cpu()
    else:
        cpu = _results.read("techniques-cpu.json")
        results = run_cuda(models(cpu), args.only)
        extra["estimates_from"] = cpu["meta"]
    rows = [{"model": name, **row} for name, model in results.items() for row in model["rows"]]
    shapes = {name: {k: v for k, v in model.items() if k != "rows"} for name, model in results.items()}
    _results.write(os.path.join(args.out, f"techniques-{args.device}.json"), rows, {"models": shapes}, **extra)


def models(data: dict) -> dict:
    """A results file back as {model: {"full": ..., "small": ..., "rows": [...]}}."""
    return {name: {**shape, "rows": [{k: v for k, v in r.items() if k != "model"} for r in data["rows"]
                                     if r["model"] == name]}
            for name, shape in data["summary"]["models"].items()}


if __name__ == "__main__":
    main()
