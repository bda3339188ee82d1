"""The depth fast path against full traces where those are affordable.

The depth path traces a 4-block copy (first, second, middle, last); a model of 6 identical blocks is the
shallowest where the middle block is written out for three blocks, each copy referencing the one before it
(that and the fast path engaging past the copy's depth is what these tests need; deeper models only cost
full traces). ``checkpointing=blocks:2`` keeps units of 2: 10 blocks, a copy of 8."""

import pytest
import transformers as tf

import memfit


def _llama(layers=6):
    return tf.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=1024, max_position_embeddings=512)


def _gpt2(layers=6):
    return tf.GPT2Config(n_embd=128, n_layer=layers, n_head=4, vocab_size=1000, n_positions=256)


@pytest.mark.parametrize("config", [_llama, _gpt2])
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_fast_path_agrees_with_full_trace(config, precision):
    full = memfit.estimate(config(), batch_size=2, seq_len=128, precision=precision, fast=False)
    fast = memfit.estimate(config(), batch_size=2, seq_len=128, precision=precision, fast=True)
    assert fast.method == "depth" and full.method == "fake"
    assert abs(fast.peak_bytes - full.peak_bytes) / full.peak_bytes < 0.01
    assert fast.parameters == full.parameters
    for phase, value in full.phase_peaks.items():
        assert abs(fast.phase_peaks[phase] - value) / value < 0.01


def test_fast_path_is_chosen_for_deep_configs_only():
    from memfit.estimator.traced import FAST_MIN_DEPTH

    assert memfit.estimate(_llama(FAST_MIN_DEPTH), seq_len=64).method == "depth"
    # one block fewer is traced in full: the threshold itself, not just "shallow" (4 passed with a threshold of 5)
    assert memfit.estimate(_llama(FAST_MIN_DEPTH - 1), seq_len=64).method == "fake"


def _trace(config, recipe, depth=None, **kwargs):
    from memfit.estimator.estimate import resolve_target
    from memfit.estimator.fake_trace import fake_trace
    from memfit.models.source import resolve
    from memfit.techniques.recipe import recipe_from

    source = resolve(config)
    recipe, factory = recipe_from(recipe, recipe.precision, recipe.optimizer)
    source = source if depth is None else source.shallow(depth)
    return fake_trace(source, None, recipe=recipe, loss_fn=None, optimizer=factory, steps=2, batch_size=2,
                      seq_len=128, gpu=resolve_target("cuda", "rtx-4090"), keep=True)[1]


def test_written_log_is_the_full_trace_log():
    """The 4-block log written out at 6 blocks is the 6-block trace's log, event for event."""
    from memfit.accounting.ledger import ALLOC, FREE
    from memfit.accounting.synth import synthesise

    recipe = memfit.Recipe(precision="bf16-mixed")
    full = _trace(_llama(6), recipe).ledger
    log = synthesise(_trace(_llama(6), recipe, depth=4).ledger, depth=6)

    def events(ledger):
        return [(kind, ledger.records[i].nbytes, ledger.records[i].category, ledger.records[i].module)
                if kind in (ALLOC, FREE) else (kind, i) for kind, i in ledger.events]
    assert log.unmatched == 0
    assert events(log) == events(full)


@pytest.mark.parametrize("recipe, layers", [
    (dict(precision="bf16-mixed", checkpointing="blocks", micro_batch_size=1, grad_accum_steps=2), 6),
    (dict(precision="bf16-mixed", checkpointing="blocks:2", lora="lora:8", chunked_loss=4), 10),
])
def test_fast_path_gives_the_allocator_figures_of_the_full_trace(recipe, layers):
    """Allocated and reserved peaks of the caching-allocator model, on a GPU target (issue 11)."""
    kwargs = dict(seq_len=256, gpu="rtx-4090", recipe=memfit.Recipe(**recipe))
    full = memfit.estimate(_llama(layers), fast=False, **kwargs)
    fast = memfit.estimate(_llama(layers), fast=True, **kwargs)
    assert fast.settings["traced_depths"] == [4 if layers == 6 else 8]
    assert fast.method == "depth" and full.method == "fake"
    for field in ("peak_bytes", "reserved_bytes", "device_bytes"):
        assert abs(getattr(fast, field) - getattr(full, field)) <= 0.01 * getattr(full, field), field
    assert (fast.parameters, fast.trainable) == (full.parameters, full.trainable)
    for phase, value in full.phase_peaks.items():
        assert abs(fast.phase_peaks[phase] - value) <= 0.01 * value, phase
