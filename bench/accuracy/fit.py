"""The largest micro-batch that fits: answers for catalog models, and real runs on this CPU.

    python -m bench fit          # writes bench/results/fit.json

Catalog rows: ``memfit.fit`` for a card, cold (no traces kept between rows): the answer, its full
estimate and the next size's, the composed prediction, how many traces and full estimates it took,
and the wall time. CPU rows: a small GPT-2 (4 blocks, width 256, vocabulary 8192, sequence 256)
fitted to a sweep of budgets with ``device="cpu"``; at the answer ``n`` and at ``n + 1`` the step
runs for real and its peak is the CPU allocator's (``memfit.truth``: the profiler's memory events
plus what existed before, no memfit tracking). Pass: the real peak at ``n`` fits, at ``n + 1`` not.
"""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import transformers as tf  # noqa: E402

import memfit  # noqa: E402
from memfit import Recipe  # noqa: E402
from memfit.models.source import resolve  # noqa: E402
from memfit.estimator.truth import true_peak  # noqa: E402
from bench import _results  # noqa: E402

RESULTS = "fit.json"
MIB = 2**20
CATALOG = [
    ("llama-3.2-1b", "rtx-4090", 2048, Recipe(precision="bf16-mixed", checkpointing="blocks")),
    ("llama-3.2-1b", "rtx-4090", 2048, Recipe(precision="bf16-mixed", checkpointing="blocks", chunked_loss=8)),
    ("llama-3.1-8b", "h100-sxm", 2048, Recipe(precision="bf16-mixed", checkpointing="blocks", chunked_loss=8)),
    ("llama-3.1-8b", "rtx-4090", 2048, Recipe(precision="bf16-mixed", checkpointing="blocks", chunked_loss=8,
                                              lora="qlora:16")),
]
SEQ = 256
CONFIG = tf.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=512,
                       architectures=["GPT2LMHeadModel"])
BUDGETS_MIB = (160, 200, 300)


def catalog_rows() -> list[dict]:
    rows = []
    for model, gpu, seq, recipe in CATALOG:  # cold: each call traces afresh (no cache= passed)
        start = time.perf_counter()
        row = {"model": model, "gpu": gpu, "seq_len": seq, "recipe": recipe.describe()}
        try:
            found = memfit.fit(model, gpu=gpu, seq_len=seq, recipe=recipe)
        except memfit.NoBatchFits as err:
            rows.append({**row, "fits": False, "message": str(err), "needed_bytes": err.needed_bytes,
                         "wall_seconds": round(time.perf_counter() - start, 1)})
            print(f"{model} {gpu} {recipe.describe()}: {err}", flush=True)
            continue
        rows.append({**row, "wall_seconds": round(time.perf_counter() - start, 1), **found.to_dict()})
        print(f"{model} {gpu} {recipe.describe()}: micro-batch {found.micro_batch_size} "
              f"({found.device_bytes / 2**30:.2f} GiB; next {found.next_bytes / 2**30:.2f} GiB), "
              f"{found.estimates} estimates, {rows[-1]['wall_seconds']} s", flush=True)
    return rows


def cpu_rows() -> list[dict]:
    source = resolve(CONFIG)
    rows = []
    for mib in BUDGETS_MIB:
        found = memfit.fit(CONFIG, device="cpu", budget=mib * MIB, seq_len=SEQ)
        n = found.micro_batch_size
        real = [true_peak(source.build, source.make_batch(m, SEQ)) for m in (n, n + 1)]
        rows.append({"budget_bytes": mib * MIB, "micro_batch_size": n, "estimate_bytes": found.device_bytes,
                     "next_estimate_bytes": found.next_bytes, "real_bytes": real[0], "next_real_bytes": real[1],
                     "pass": real[0] <= mib * MIB < real[1], "estimates": found.estimates,
                     "seconds": round(found.seconds, 1)})
        print(f"{mib} MiB: micro-batch {n}, real {real[0] / MIB:.2f} MiB / next {real[1] / MIB:.2f} MiB",
              flush=True)
    return rows


def main() -> None:

    path = _results.write(RESULTS, _results.tables(catalog=catalog_rows(), cpu=cpu_rows()))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
