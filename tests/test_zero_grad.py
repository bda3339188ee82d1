"""set_to_none=False: gradients zeroed in place stay through the next forward; the estimate follows
the CPU allocator, and the depth fast path follows the full trace."""

import pytest
import transformers as tf

import memfit
from memfit import Recipe
from memfit.estimator.truth import true_peak
from memfit.models.zoo import CASES


@pytest.mark.parametrize("name", ["mlp", "gpt", "hf-llama"])
def test_kept_gradients_match_the_allocator(name):
    factory, make_batch, loss_fn = CASES[name]
    forward = {}
    for set_to_none in (True, False):
        recipe = Recipe(set_to_none=set_to_none)
        batch = make_batch()
        report = memfit.estimate(factory, batch, loss_fn=loss_fn, recipe=recipe)
        measured = true_peak(factory, batch, loss_fn=loss_fn, recipe=recipe)
        assert abs(report.peak_bytes - measured) <= 16, (set_to_none, report.peak_bytes, measured)
        forward[set_to_none] = report.phase_peaks["forward"]
    gradients = memfit.estimate(factory, make_batch(), loss_fn=loss_fn).by_category["gradients"]
    # step 2's forward holds every gradient when they are only zeroed
    assert forward[False] - forward[True] >= 0.9 * gradients


def test_fast_path_equals_full_trace():
    config = tf.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=12, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
                            architectures=["LlamaForCausalLM"])
    recipe = Recipe(set_to_none=False, precision="bf16-mixed")
    fast = memfit.estimate(config, recipe=recipe, batch_size=2, seq_len=64, gpu="rtx-4090", fast=True)
    full = memfit.estimate(config, recipe=recipe, batch_size=2, seq_len=64, gpu="rtx-4090", fast=False)
    assert fast.method == "depth" and fast.peak_bytes == full.peak_bytes
    assert fast.reserved_bytes == full.reserved_bytes
