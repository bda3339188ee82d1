"""torchao's 8-bit, 4-bit and FP8 AdamW: estimated on fake tensors (state made by torchao, the compiled
step's buffers from ``techniques/_lowbit.py``), graded by the CPU allocator on the real compiled step.

The truth compiles torchao's step once per parameter shape (Inductor, C++ on this CPU): the model
has three shapes, small enough to compile in seconds, chosen to cover every branch of the rule: a
plain moment (LayerNorm, 256 values), a quantised one below 256 blocks and one at 256 blocks."""

import functools

import pytest
import torch
import transformers as tf

import memfit
from memfit import Recipe
from memfit.estimator.truth import true_peak

pytest.importorskip("torchao")


def _factory():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256, bias=False), torch.nn.LayerNorm(256, bias=False),
                               torch.nn.Linear(256, 256, bias=False))


def _loss(model, batch):
    return model(batch["x"]).square().mean()


def _batch():
    return {"x": torch.randn(8, 64, generator=torch.Generator().manual_seed(0))}




@functools.cache
def _estimate(optimizer):
    """The estimate of the module's model with ``optimizer`` (reports are frozen: shared between tests)."""
    return memfit.estimate(_factory, _batch(), loss_fn=_loss, recipe=Recipe(optimizer=optimizer))


@pytest.mark.parametrize("optimizer", ["ao_adamw8bit", "adamw4bit", "ao_adamw_fp8"])
def test_estimate_equals_the_allocator(optimizer):
    recipe = Recipe(optimizer=optimizer)
    report = _estimate(optimizer)
    measured = true_peak(_factory, _batch(), loss_fn=_loss, recipe=recipe)
    assert report.peak_bytes == measured, (report.peak_bytes, measured)
    assert report.phase_peaks["optimizer"] == report.peak_bytes  # the step's buffers make the peak here


# torchao's layout (subclass_8bit/4bit/fp8.py): codes, one fp32 scale per block, a fp32 table per
# moment for 8/4-bit; parameters under 4096 values keep plain moments of their dtype
LAYOUT = {  # name: (code bytes per value, values per block, table entries)
    "ao_adamw8bit": (1, 256, 256), "adamw4bit": (0.5, 128, 16), "hf_adamw4bit": (0.5, 256, 16),
    "ao_adamw_fp8": (1, 256, 0)}


@pytest.mark.parametrize("optimizer", list(LAYOUT))
def test_state_is_torchaos_layout(optimizer):
    code, block, table = LAYOUT[optimizer]
    expected = 0
    for p in _factory().parameters():
        n = p.numel()
        per_moment = int(n * code) + 4 * n // block + 4 * table if n >= 4096 else 4 * n
        expected += 2 * per_moment + 4  # two moments and the fp32 step counter
    assert _estimate(optimizer).by_category["optimizer_state"] == expected


def test_four_bit_step_outgrows_eight_bit_state_savings():
    """4-bit state is half 8-bit's, but its step holds 26 bytes per value of a parameter; the fake
    step's stand-in for ``torch.compile`` is gone afterwards."""
    peaks = {o: _estimate(o) for o in ("ao_adamw8bit", "adamw4bit")}
    # after these estimates and any the module made before; not "is torch.compile as at import": Lightning
    # replaces torch.compile with its own wrapper when a test of its scripts first imports it
    assert not getattr(torch.compile, "__module__", "").startswith("memfit"), torch.compile
    assert peaks["adamw4bit"].by_category["optimizer_state"] < peaks["ao_adamw8bit"].by_category["optimizer_state"]
    assert peaks["adamw4bit"].peak_bytes > peaks["ao_adamw8bit"].peak_bytes


def test_fast_path_equals_full_trace():
    """6 blocks: the shallowest past the 4-block copy where the middle block is written out three times."""
    config = tf.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=6, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
                            architectures=["LlamaForCausalLM"])
    for optimizer in ("ao_adamw8bit", "adamw4bit"):
        recipe = Recipe(optimizer=optimizer, precision="bf16-mixed")
        fast = memfit.estimate(config, recipe=recipe, batch_size=2, seq_len=64, gpu="rtx-4090", fast=True)
        full = memfit.estimate(config, recipe=recipe, batch_size=2, seq_len=64, gpu="rtx-4090", fast=False)
        assert fast.method == "depth" and fast.settings["traced_depths"] == [4] and full.method == "fake", optimizer
        assert fast.peak_bytes == full.peak_bytes, optimizer
        assert fast.by_category == full.by_category and fast.reserved_bytes == full.reserved_bytes


def test_low_bit_optimizers_change_the_math_and_take_no_impl():
    assert not Recipe(optimizer="ao_adamw_fp8").is_exact
    with pytest.raises(memfit.MemfitError, match="optimizer_impl=fused and optimizer=ao_adamw8bit"):
        Recipe(optimizer="ao_adamw8bit", optimizer_impl="fused")


def test_in_backward_steps_torchaos_optimizer_and_keeps_its_lr_a_tensor():
    """optimizer_in_backward hands its group's hyperparameters (a scheduler's lr) to each parameter's own optimizer;
    torchao refuses a float lr ("lr was changed to a non-Tensor object"), so a tensor lr is filled in place. The
    estimate runs and the allocator agrees."""
    recipe = Recipe(optimizer="ao_adamw8bit", optimizer_in_backward=True)
    report = memfit.estimate(_factory, _batch(), loss_fn=_loss, recipe=recipe)
    assert report.peak_bytes == true_peak(_factory, _batch(), loss_fn=_loss, recipe=recipe)

    from memfit.techniques._lowbit import lowbit_optimizer
    from memfit.techniques.optimizer_in_backward import InBackward

    model = _factory()
    wrapper = InBackward(model.parameters(), lambda params: lowbit_optimizer("ao_adamw8bit", params, lr=1e-4))
    wrapper.param_groups[0]["lr"] = 5e-5  # what an LR scheduler writes
    _loss(model, _batch()).backward()
    for inner in wrapper.optimizers.values():
        lr = inner.param_groups[0]["lr"]
        assert isinstance(lr, torch.Tensor) and lr.item() == pytest.approx(5e-5)
    assert all(len(inner.state) for inner in wrapper.optimizers.values())  # every parameter stepped
