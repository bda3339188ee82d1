"""The depth fast path against full traces where those are affordable."""

import pytest
import transformers as tf

import memfit


def _llama(layers=10):
    return tf.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=1024, max_position_embeddings=512)


def _gpt2(layers=9):
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
    assert memfit.estimate(_llama(8), seq_len=64).method == "depth"
    assert memfit.estimate(_llama(4), seq_len=64).method == "fake"
