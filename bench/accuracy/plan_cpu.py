"""Does the planner's choice fit, and is it fast? Checked with real runs on this CPU.

    python -m bench plan_cpu        # writes bench/results/plan-cpu.json

A small GPT-2 (4 blocks, width 256, vocabulary 8192, sequence 256, global batch 16) is planned for a
sweep of budgets with ``device="cpu"`` (CPU semantics, this CPU's measured speeds). For each budget
the chosen recipe runs for real: its peak is the CPU allocator's (``memfit.truth``: the profiler's
memory events plus what existed before, no memfit tracking) and its step time the median of five
steps after a warm-up. A grid of recipes (precision x checkpointing x chunked loss x micro-batch)
is measured the same way; for each budget the fastest grid point whose measured peak fits is the
reference, timed again right after the chosen recipe (CPU step times drift by 10-20 % over
minutes on a shared machine). Pass: measured peak <= budget, and step time within 10 % of that
reference (or faster).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import torch  # noqa: E402
import transformers as tf  # noqa: E402

import memfit  # noqa: E402
from memfit import Recipe  # noqa: E402
from memfit.techniques.apply import apply  # noqa: E402
from memfit.planner.cost import Speed  # noqa: E402
from memfit.models.source import resolve  # noqa: E402
from memfit.estimator.truth import true_peak  # noqa: E402
from bench import _results  # noqa: E402

RESULTS = "plan-cpu.json"
GLOBAL, SEQ = 16, 256
CONFIG = tf.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=512,
                       architectures=["GPT2LMHeadModel"])


def _batch(source):
    torch.manual_seed(0)
    return source.make_batch(GLOBAL, SEQ)


def _seconds(source, batch, recipe, repeats=5) -> float:
    torch.manual_seed(0)
    model = source.build()
    _, _, step = apply(model, recipe)
    step(batch)  # warm-up: optimizer state, allocator caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure(source, batch, recipe, repeats=5) -> dict:
    return {"peak_bytes": true_peak(source.build, batch, recipe=recipe),
            "step_seconds": round(_seconds(source, batch, recipe, repeats), 4)}


def grid() -> list[Recipe]:
    out = []
    for precision in ("fp32", "bf16-mixed"):
        for checkpointing in ("off", "blocks"):
            for chunks in (0, 8):
                for mb in (1, 2, 4, 8, 16):
                    out.append(Recipe(precision=precision, checkpointing=checkpointing, chunked_loss=chunks,
                                      micro_batch_size=mb, grad_accum_steps=GLOBAL // mb))
    return out


def main() -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    source = resolve(CONFIG)
    batch = _batch(source)
    print(f"grid: {len(grid())} recipes measured for real (peak by the allocator, median step time)", flush=True)
    measured = []
    for recipe in grid():
        row = {"recipe": recipe.to_dict(), "describe": recipe.describe(), **_measure(source, batch, recipe, 3)}
        measured.append(row)
        print(f"  {memfit.format_size(row['peak_bytes']):>11} {row['step_seconds']:7.3f} s  {row['describe']}", flush=True)
    peaks = sorted(r["peak_bytes"] for r in measured)
    budgets = sorted({peaks[int(q * (len(peaks) - 1))] for q in (0.05, 0.2, 0.35, 0.5, 0.7, 0.9)})
    sweep = []
    from memfit.planner.cache import EngineCache

    cache = EngineCache()  # one config under every budget: traced once
    for budget in budgets:
        start = time.perf_counter()
        try:
            plans = memfit.plan(CONFIG, device="cpu", budget=budget, global_batch_size=GLOBAL, seq_len=SEQ,
                                cache=cache)
        except memfit.NothingFits as err:
            sweep.append({"budget_bytes": budget, "fits": False, "message": str(err)})
            print(f"budget {memfit.format_size(budget)}: {err}", flush=True)
            continue
        planning = time.perf_counter() - start
        chosen = plans.best
        real = _measure(source, batch, chosen.recipe)
        fitting = [r for r in measured if r["peak_bytes"] <= budget]
        best = min(fitting, key=lambda r: r["step_seconds"]) if fitting else None
        if best is not None:  # timed again beside the chosen one: the two share the machine's state
            best = {**best, "step_seconds": round(_seconds(source, batch, Recipe.from_dict(best["recipe"])), 4)}
        ratio = real["step_seconds"] / best["step_seconds"] if best else None
        row = {"budget_bytes": budget, "fits": True, "chosen": chosen.recipe.describe(),
               "predicted_bytes": chosen.device_bytes, "measured_bytes": real["peak_bytes"],
               "within_budget": real["peak_bytes"] <= budget, "predicted_seconds": round(chosen.step_seconds, 4),
               "measured_seconds": real["step_seconds"], "best_grid": best and best["describe"],
               "best_grid_seconds": best and best["step_seconds"],
               "time_vs_best_grid": ratio and round(ratio, 3), "within_10_percent": ratio is not None and ratio <= 1.10,
               "planning_seconds": round(planning, 1), "candidates": plans.candidates}
        sweep.append(row)
        print(f"budget {memfit.format_size(budget)}: {row['chosen']} → measured {memfit.format_size(real['peak_bytes'])}"
              f" ({'fits' if row['within_budget'] else 'OVER'}), {real['step_seconds']:.3f} s vs best grid "
              f"{best and best['step_seconds']} s ({best and best['describe']}): x{ratio and round(ratio, 3)}", flush=True)
    _results.write(RESULTS, _results.tables(sweep=sweep, grid=measured), model="GPT-2 4 x 256, vocab 8192",
                   global_batch_size=GLOBAL, seq_len=SEQ, speed=dict(Speed.host().__dict__))


if __name__ == "__main__":
    main()
