"""SafeStep: the same update as optimizer.step() bit for bit; an OOM injected at every allocation
of the step leaves no parameter half updated and the run ends where a fault-free run ends; a plain
foreach step hit the same way does not; and chunking lowers the step's peak."""

import pytest
import torch

from memfit import MemfitError
from memfit.techniques.safe_step import SafeStep
from memfit.accounting.budget import VirtualBudget

OPTIMIZERS = {
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw-forloop": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True),
}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 8))


def _grads(model, step):
    torch.manual_seed(100 + step)
    model(torch.randn(16, 32)).pow(2).mean().backward()


def _run(name, steps=3, fault=None, safe=True, chunks=4):
    """Train ``steps`` steps; ``fault=(step, nth)`` fails the nth allocation of that step's update."""
    model = _model()
    opt = OPTIMIZERS[name](model.parameters())
    stepper = SafeStep(opt, chunks) if safe else opt.step
    inject = [] if fault is None else [(fault[0], 0, "optimizer", fault[1])]
    escaped = 0
    with VirtualBudget(inject=inject) as budget:
        for step in range(steps):
            budget.at(step, 0, "forward")
            _grads(model, step)
            budget.at(step, 0, "optimizer")
            try:
                stepper()
            except torch.OutOfMemoryError:
                escaped += 1
                stepper()  # memory freed: go on with the same gradients
            opt.zero_grad()
    return model, opt, budget, escaped


def _same(a, b):
    (ma, oa), (mb, ob) = a, b
    if not all(torch.equal(x, y) for x, y in zip(ma.parameters(), mb.parameters())):
        return False
    for pa, pb in zip(ma.parameters(), mb.parameters()):
        sa, sb = oa.state[pa], ob.state[pb]
        if sa.keys() != sb.keys() or not all(torch.equal(sa[k], sb[k]) for k in sa):
            return False
    return True


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_same_update_as_a_plain_step(name):
    plain, opt, _, _ = _run(name, safe=False)
    safe, sopt, _, _ = _run(name)
    assert _same((plain, opt), (safe, sopt))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_an_oom_at_any_allocation_of_the_step_loses_nothing(name):
    reference, ref_opt, _, _ = _run(name)
    probe = _run(name, steps=2, fault=(1, 10**9))[2]  # counts the allocations of step 1's update
    count = probe.allocations
    assert count > 4
    for nth in range(1, count + 1):
        model, opt, budget, escaped = _run(name, fault=(1, nth))
        assert budget.fired == [(1, 0, "optimizer")]
        assert _same((reference, ref_opt), (model, opt)), f"fault at allocation {nth} of {count}"


def test_a_plain_foreach_step_hit_by_an_oom_is_half_applied():
    reference, ref_opt, _, _ = _run("adamw-foreach", safe=False)
    broken = 0
    probe = _run("adamw-foreach", steps=2, fault=(1, 10**9), safe=False)[2]
    for nth in range(1, probe.allocations + 1):
        model, opt, _, escaped = _run("adamw-foreach", fault=(1, nth), safe=False)
        broken += escaped and not _same((reference, ref_opt), (model, opt))
    assert broken > 0  # the reason SafeStep exists


def test_chunks_lower_the_step_peak():
    peaks = {}
    for chunks, safe in ((1, False), (8, True)):
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        step = SafeStep(opt, chunks) if safe else opt.step
        model(torch.randn(4, 256)).sum().backward()
        step()  # state exists
        model(torch.randn(4, 256)).sum().backward()
        with VirtualBudget() as budget:
            step()
        peaks[chunks] = budget.peak
    assert peaks[8] < 0.7 * peaks[1]


def test_lbfgs_is_refused():
    with pytest.raises(MemfitError, match="LBFGS"):
        SafeStep(torch.optim.LBFGS(_model().parameters()))


# --- as a technique: Recipe(safe_step=k) is what estimate traces and memfit train runs ------------

@pytest.mark.parametrize("name", ["mlp", "hf-llama"])
def test_the_chunked_step_is_estimated_as_the_allocator_runs_it(name):
    import memfit
    from memfit import Recipe
    from memfit.estimator.truth import true_peak
    from memfit.models.zoo import CASES

    factory, make_batch, loss_fn = CASES[name]
    peaks = {}
    for chunks in (None, 8):
        recipe = Recipe(safe_step=chunks, optimizer_impl="foreach")
        batch = make_batch()
        report = memfit.estimate(factory, batch, loss_fn=loss_fn, recipe=recipe)
        measured = true_peak(factory, batch, loss_fn=loss_fn, recipe=recipe)
        assert abs(report.peak_bytes - measured) <= 16, (chunks, report.peak_bytes, measured)
        peaks[chunks] = report.phase_peaks["optimizer"]
    # each chunk holds copies of its parameters and state (AdamW: 3x its bytes) and its own temporaries:
    # lower than foreach's temporaries over everything when parameters are many and even (the Llama),
    # higher when one weight is most of the model (the MLP)
    assert (peaks[8] < peaks[None]) == (name == "hf-llama"), peaks


def test_the_fast_path_traces_it_in_full():
    # chunks are cut by the bytes of all parameters, not block by block: nothing to write out by depth
    import transformers as tf

    import memfit
    from memfit import Recipe

    # 6 blocks: more than the 4 the depth path traces (without safe_step this config's fast estimate is "depth")
    config = tf.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=6, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
                            architectures=["LlamaForCausalLM"])
    recipe = Recipe(safe_step=8, precision="bf16-mixed")
    fast = memfit.estimate(config, recipe=recipe, batch_size=2, seq_len=64, fast=True)
    full = memfit.estimate(config, recipe=recipe, batch_size=2, seq_len=64, fast=False)
    assert fast.method == full.method and fast.peak_bytes == full.peak_bytes


@pytest.mark.parametrize("changes, message", [
    (dict(precision="fp16-mixed"), "GradScaler"), (dict(optimizer_in_backward=True), "no optimizer step"),
    (dict(optimizer="adamw8bit"), "quantised state"), (dict(safe_step=0), "number of chunks")])
def test_what_cannot_be_chunked_is_refused_in_one_line(changes, message):
    from memfit import Recipe

    with pytest.raises(MemfitError, match=message):
        Recipe(**{"safe_step": 4, **changes})
