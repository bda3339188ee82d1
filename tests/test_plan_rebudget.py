"""The planner's check under a budget replays its whole-card trace (``estimator/rebudget.py``): the same
report a fresh budgeted ``estimate`` makes, field by field, without a second trace; and where the estimate
was not one plain trace (accumulation read off a line), the full budgeted estimate instead."""

import dataclasses

import pytest

from memfit import Recipe, estimate, plan
from memfit.estimator.estimate import resolve_target
from memfit.estimator.rebudget import recording, replayable
from memfit.models.source import resolve
from memfit.planner.compose import Engine

from test_plan import GPU, _config

MiB = 2**20
SELECTIVE = Recipe(precision="bf16-mixed", micro_batch_size=8, checkpointing="selective")
PLAIN = Recipe(micro_batch_size=8)
# (recipe, budget beyond what is outside the allocator (MiB), the verdict and retries that budget gives).
# Unbudgeted, SELECTIVE reserves 50 MiB, PLAIN 58 MiB (both fit the card, no retries): each budget below
# makes the allocator's replay under the limit differ from the whole card's.
CASES = [
    (SELECTIVE, 80, "fits", 0),  # the unlimited run, with room to spare (not tight)
    (SELECTIVE, 49, "fits", 1),  # fits after freeing cached blocks and retrying
    (SELECTIVE, 47, "out_of_memory", 1),
    (PLAIN, 57, "fits_with_expandable_segments", 0),
    (PLAIN, 40, "out_of_memory", 1),
]


@pytest.fixture(scope="module")
def setup():
    source = resolve(_config())
    gpu = resolve_target("cuda", GPU)
    return source, gpu, Engine(source, None, gpu, 128, None, "adamw", 8, None)


# Selective checkpointing frees a block's saved tensors in one burst whose order varies from trace to trace
# (torch's selective-checkpoint cache): two fresh traces of SELECTIVE differ in the live bytes the timeline
# samples inside that burst, never in what the allocator sees (the frees between two allocations are the same
# set: measured), so those two fields are compared with the trace the replay was made from instead.
ORDERED = {"timeline", "stacked"}


def _fields(report, leave=()) -> dict:
    return {f.name: getattr(report, f.name) for f in dataclasses.fields(report) if f.name not in leave}


@pytest.mark.parametrize("recipe,mib,verdict,retries", CASES, ids=[f"{r.checkpointing}-{m}" for r, m, _, _ in CASES])
def test_replayed_budget_is_the_budgeted_estimate(setup, recipe, mib, verdict, retries):
    source, gpu, engine = setup
    budget = gpu.outside_bytes + mib * MiB
    whole = engine.verify(recipe)
    traces = engine.traces
    replayed = engine.verify(recipe, budget)
    assert engine.traces == traces and recipe in engine._replays  # no trace: a replay
    # the same call Engine.verify makes, estimated afresh under the budget
    fresh = estimate(source, recipe=recipe, seq_len=128, device="cuda", gpu=gpu, budget=budget)
    assert (fresh.verdict, fresh.retries) == (verdict, retries)
    leave = ORDERED if recipe is SELECTIVE else ()
    assert _fields(replayed, leave) == _fields(fresh, leave)
    assert {k: v for k, v in replayed.to_dict().items() if k not in leave} == \
        {k: v for k, v in fresh.to_dict().items() if k not in leave}
    assert all(getattr(replayed, k) == getattr(whole, k) for k in leave)
    # what the replay changes: the budget, and (tight budgets) the allocator's run under it
    changed = {k for k, v in _fields(whole).items() if _fields(fresh)[k] != v}
    assert "budget_bytes" in changed and "capacity_bytes" in changed
    if mib < 50:
        assert {"verdict", "retries", "reserved_bytes"} & changed


def test_each_recipe_traced_once(setup):
    """After the cases above: one trace per recipe, every budget a replay (run after them: module order)."""
    _, _, engine = setup
    assert engine.traces == 2 and engine.replays == len(CASES)


def test_a_line_is_not_replayed(setup):
    """Accumulation read off the line through 2 and 3 micro-batches is not one trace: no replay kept."""
    source, gpu, _ = setup
    recipe = Recipe(precision="bf16-mixed", micro_batch_size=1, grad_accum_steps=8)
    with recording() as found:
        report = estimate(source, recipe=recipe, seq_len=128, device="cuda", gpu=gpu)
    assert found.spoiled and len(found.offers) == 2 and replayable(found, report) is None
    with recording() as found:  # the same recording of one plain trace is replayable
        report = estimate(source, recipe=SELECTIVE, seq_len=128, device="cuda", gpu=gpu)
    assert replayable(found, report) is not None


def test_plan_checks_by_replay():
    """A plan whose one candidate fits the card but not the budget as it is: its budgeted check is a replay
    (``settings["replays"]``), and the answer the full estimate under the budget gives (release-and-retry)."""
    gpu = resolve_target("cuda", GPU)
    fixed = {"precision": "bf16-mixed", "checkpointing": "selective", "micro_batch_size": 8}
    plans = plan(_config(), gpu=GPU, budget=gpu.outside_bytes + 49 * MiB, global_batch_size=8, seq_len=128,
                 fixed=fixed)
    assert plans.settings["replays"] >= 1
    assert plans.report.verdict == "fits" and plans.report.retries == 1
    fresh = estimate(resolve(_config()), recipe=plans.best.recipe, seq_len=128, device="cuda", gpu=gpu,
                     budget=gpu.outside_bytes + 49 * MiB)
    assert _fields(plans.report, ORDERED) == _fields(fresh, ORDERED)
