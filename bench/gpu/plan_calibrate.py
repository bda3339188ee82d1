"""Check the planner's step-time model against step times recorded on a real GPU.

Predicts, on this CPU-only machine, the step time of each recipe of ``bench/gpu/cuda_checks.py`` (a
Llama-shaped 8 x 1024 model, batch 8 x 1024) with the H100's catalog figures, and compares with
the times that script recorded on an H100 (``bench/results/cuda-checks-h100.json``). Writes
``bench/results/plan-calibration-h100.json``.

    python -m bench plan_calibrate
"""

from __future__ import annotations

import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file

import transformers as tf  # noqa: E402

from memfit import Recipe  # noqa: E402
from memfit.planner.cost import EFFICIENCY  # noqa: E402
from memfit.estimator.estimate import resolve_target  # noqa: E402
from memfit.models.source import resolve  # noqa: E402
from memfit.planner.compose import Engine  # noqa: E402

from bench import _results  # noqa: E402

RESULTS = "plan-calibration-h100.json"


def main() -> None:
    recorded = _results.read("cuda-checks-h100.json")
    measured_rows = _results.by_name(recorded["rows"])
    config = tf.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                            num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
    source = resolve(config)
    gpu = resolve_target("cuda", "h100-sxm")
    recipes = {name: Recipe.from_dict(row["fields"]).replace(micro_batch_size=8, grad_accum_steps=1)
               for name, row in measured_rows.items() if "fields" in row}
    recipes = {n: r.replace(micro_batch_size=2) if r.grad_accum_steps > 1 or n.startswith("accumulation") else r
               for n, r in recipes.items()}
    recipes["accumulation x4"] = recipes["accumulation x4"].replace(micro_batch_size=2, grad_accum_steps=4)
    rows = {}
    for name, recipe in recipes.items():
        if recipe.offload_optimizer:
            continue  # not estimated on fake tensors, so not planned
        engine = Engine(source, None, gpu, 1024, None, recipe.optimizer, 8, None)
        engine.prepare([recipe])
        predicted = engine.predict(recipe).step_seconds
        measured = measured_rows[name]["step_seconds"]
        rows[name] = {"predicted_seconds": round(predicted, 4), "measured_seconds": measured,
                      "error": round(predicted / measured - 1, 3)}
        print(f"{name:32} predicted {predicted:7.4f} s  measured {measured:7.4f} s  {predicted / measured - 1:+.0%}")
    errors = [abs(r["error"]) for r in rows.values()]
    summary = {"median_abs_error": round(statistics.median(errors), 3), "max_abs_error": round(max(errors), 3)}
    print(summary)
    _results.write(RESULTS, _results.named(rows), summary, measured_on=recorded["meta"], efficiency=EFFICIENCY)


if __name__ == "__main__":
    main()
