"""optimizer_impl: torch's foreach, fused and for-loop steps, each estimated as the CPU allocator
measures it, the same update within rounding, and refused in one line where torch has no such
implementation."""

import pytest
import torch

import memfit
from memfit import MemfitError, Recipe
from memfit.estimator.truth import true_peak
from memfit.models.zoo import CASES


@pytest.mark.parametrize("name", ["mlp", "gpt"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_each_implementation_matches_the_allocator(name, optimizer):
    factory, make_batch, loss_fn = CASES[name]
    peaks = {}
    for impl in ("foreach", "fused", "forloop"):
        recipe = Recipe(optimizer=optimizer, optimizer_impl=impl)
        batch = make_batch()
        report = memfit.estimate(factory, batch, loss_fn=loss_fn, recipe=recipe)
        estimated = report.peak_bytes
        measured = true_peak(factory, batch, loss_fn=loss_fn, recipe=recipe)
        # within 16 bytes: the step counters are 4-byte scalars the allocator rounds its own way
        assert abs(estimated - measured) <= 16, (impl, estimated, measured)
        peaks[impl] = report.phase_peaks["optimizer"]
    if optimizer == "adamw":  # fused: no parameter-sized step temporaries
        assert peaks["fused"] < min(peaks["forloop"], peaks["foreach"])


def test_fused_and_foreach_give_the_same_update():
    factory, make_batch, loss_fn = CASES["gpt"]
    batch = make_batch()
    states = {}
    for impl in ("foreach", "fused", "forloop"):
        torch.manual_seed(0)
        model = factory()
        _, _, step = memfit.apply(model, Recipe(optimizer_impl=impl), loss_fn=loss_fn)
        step(batch)
        states[impl] = [p.detach().clone() for p in model.parameters()]
    for impl in ("fused", "forloop"):
        for a, b in zip(states["foreach"], states[impl]):
            # Adam's first update is about lr * sign(grad): within 1% of lr (1e-4) everywhere
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_impossible_implementations_are_one_line():
    with pytest.raises(MemfitError, match="no fused adafactor"):
        Recipe(optimizer="adafactor", optimizer_impl="fused")
    with pytest.raises(MemfitError, match="optimizer_impl=fused and optimizer=adamw8bit"):
        Recipe(optimizer="adamw8bit", optimizer_impl="fused")
    with pytest.raises(MemfitError, match="unknown optimizer_impl"):
        Recipe(optimizer_impl="apex")
    factory, make_batch, loss_fn = CASES["mlp"]
    with pytest.raises(MemfitError, match="custom optimizer"):
        memfit.estimate(factory, make_batch(), loss_fn=loss_fn, recipe=Recipe(optimizer_impl="fused"),
                        optimizer=lambda params: torch.optim.AdamW(params))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_fused_is_as_close_to_exact_arithmetic_as_foreach(optimizer):
    """Three steps: fused and foreach drift apart where Adam divides by a near-zero second moment
    (rounding of tiny gradients, amplified), so "within rounding" is checked against float64: the
    fused parameters are as close to a float64 run of the same steps as foreach's."""
    factory, make_batch, loss_fn = CASES["gpt"]
    states = {}
    for impl, dtype in (("foreach", torch.float64), ("foreach", torch.float32), ("fused", torch.float32)):
        torch.manual_seed(0)
        model = factory().to(dtype)
        _, _, step = memfit.apply(model, Recipe(optimizer=optimizer, optimizer_impl=impl), loss_fn=loss_fn)
        for _ in range(3):
            step(make_batch())
        states[impl, dtype] = torch.cat([p.detach().double().flatten() for p in model.parameters()])
    exact = states["foreach", torch.float64]
    err = {impl: (states[impl, torch.float32] - exact).abs() for impl in ("foreach", "fused")}
    assert err["fused"].max() <= 1.5 * err["foreach"].max()
    assert err["fused"].mean() <= 1.5 * err["foreach"].mean()


def test_planner_offers_fused_and_its_prediction_is_the_estimate():
    import transformers as tf

    from memfit.estimator.estimate import resolve_target
    from memfit.models.source import resolve
    from memfit.planner.compose import Engine
    from memfit.planner.space import search_space

    config = tf.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
                            architectures=["LlamaForCausalLM"])
    engine = Engine(resolve(config), None, resolve_target("cuda", "rtx-4090"), 64, None, "adamw", 2, None)
    assert {r.optimizer_impl for r in search_space(engine, set(), "adamw")} == {"auto", "fused"}
    assert {r.optimizer_impl for r in search_space(engine, set(), "adafactor")} == {"auto"}
    # the graph's axes fixed (one graph trace): the search over the optimizer's, the step's and the
    # micro-batch's is what offers fused
    plans = memfit.plan(config, gpu="rtx-4090", global_batch_size=2, seq_len=64,
                        fixed={"precision": "bf16-mixed", "checkpointing": "off", "offload_activations": False,
                               "chunked_loss": 0})
    assert {p.recipe.optimizer_impl for p in plans} == {"auto", "fused"}
    best = plans.best
    assert best.recipe.optimizer_impl == "fused" and best.recipe.is_exact
    assert any(reason.startswith("optimizer_impl=fused:") for reason in best.reasons)
    full = memfit.estimate(config, recipe=best.recipe, seq_len=64, gpu="rtx-4090")
    assert best.allocated_bytes == full.peak_bytes


def test_fused_has_no_step_temporaries_under_cuda_semantics():
    """Under CUDA semantics ``auto`` is foreach, whose step holds a parameter-sized list
    (``_foreach_sqrt``); fused holds none: its optimizer phase is params + grads + state + what
    was live before (batch, cuBLAS workspaces)."""
    factory, make_batch, loss_fn = CASES["gpt"]
    reports = {impl: memfit.estimate(factory, make_batch(), loss_fn=loss_fn, device="cuda",
                                     recipe=Recipe(optimizer_impl=impl)) for impl in ("auto", "fused")}
    params = reports["fused"].by_category["parameters"]
    saved = reports["auto"].phase_peaks["optimizer"] - reports["fused"].phase_peaks["optimizer"]
    assert params <= saved <= params + 4096  # one fp32 list, rounded up to 512 B per tensor
