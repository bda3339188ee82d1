"""The generation fast path (``generation/fast.py``: the prefill and the last decode step, traced short on a
shallow copy and written out at full depth) against the full trace of every step; ``memfit estimate --generate``."""

import json

import pytest
import transformers as tf

from memfit.cli import estimate as cli_estimate
from memfit.cli import main
from memfit.errors import MemfitError
from memfit.generation import estimate_generate
from memfit.generation.cache import CACHES
from memfit.generation.fast import FAST_FROM, choose_fast
from memfit.generation.run import Request
from memfit.models.source import resolve
from memfit.generation.weights import DTYPES, WEIGHTS

BASE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
            max_position_embeddings=512)


def _llama(layers=5):
    return tf.LlamaConfig(**BASE, num_hidden_layers=layers)  # grouped-query attention: 4 query / 2 kv heads


def _mistral():
    return tf.MistralConfig(**BASE, num_hidden_layers=5, sliding_window=8)


def _t5():
    return tf.T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=256,
                       decoder_start_token_id=0)


@pytest.mark.parametrize("config, kwargs", [
    (_llama, dict(prompt_len=4, new_tokens=8, batch_size=2)),  # decode peaks above prefill (asserted)
    (_mistral, dict(prompt_len=16, new_tokens=6, batch_size=2)),  # prompt longer than the window
    (_llama, dict(prompt_len=12, new_tokens=6, batch_size=2, cache="static")),
    (_llama, dict(prompt_len=12, new_tokens=6, batch_size=3, padding=True, precision="fp32")),
], ids=["llama-gqa-long-decode", "mistral-sliding", "llama-static", "llama-padded-fp32"])
def test_fast_equals_the_full_trace(config, kwargs):
    full = estimate_generate(config(), fast=False, **kwargs)
    fast = estimate_generate(config(), fast=True, **kwargs)
    assert fast.method == "depth" and any("fast path" in n for n in fast.notes)
    if kwargs["prompt_len"] == 4:  # the case whose peak is the last decode step's: the fast path's own step
        assert full.phase_peaks["decode"] > full.phase_peaks["prefill"]
    assert abs(fast.peak_bytes - full.peak_bytes) <= 0.01 * full.peak_bytes, (fast.peak_bytes, full.peak_bytes)
    # measured: byte-exact, but for depth.py's 8 bytes per sliding-window layer of the shallow copy's set-up
    assert abs(fast.peak_bytes - full.peak_bytes) <= 8 * 5
    for phase in ("prefill", "decode"):
        assert abs(fast.phase_peaks[phase] - full.phase_peaks[phase]) <= 8 * 5, phase
    assert fast.parameters == full.parameters
    assert abs(fast.by_category["kv_cache"] - full.by_category["kv_cache"]) <= 8 * 5


def test_the_fast_path_is_the_default_past_its_threshold():
    report = estimate_generate(_llama(2), prompt_len=8, new_tokens=FAST_FROM // 2 + 1)
    assert report.method == "fast" and report.settings["new_tokens"] == FAST_FROM // 2 + 1
    assert report.peak_bytes == report.phase_peaks["decode"] > report.phase_peaks["prefill"]


def test_encoder_decoder_falls_back_to_the_full_trace():
    # past the threshold the fast path would be taken, but it is not exact for T5: traced in full, with the reason
    go, note = choose_fast(None, resolve(_t5()), Request(4, FAST_FROM))
    assert not go and "cross-attention" in note
    assert choose_fast(None, resolve(_llama()), Request(4, FAST_FROM)) == (True, None)
    assert choose_fast(None, resolve(_llama()), Request(4, 8)) == (False, None)
    with pytest.raises(MemfitError, match="fast=True and this generation conflict"):
        estimate_generate(_t5(), prompt_len=4, new_tokens=8, fast=True)


def test_the_cli_mirrors_the_generation_names():
    assert cli_estimate.WEIGHT_CHOICES == WEIGHTS and cli_estimate.GENERATE_PRECISIONS == tuple(DTYPES)
    assert all(kind in cli_estimate.CACHE_HELP for kind in CACHES if not kind.startswith("offloaded"))


@pytest.fixture
def llama_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(_llama(2).to_json_string())
    return str(path)


def test_cli_generate_json_and_table(llama_json, capsys):
    assert main(["estimate", llama_json, "--generate", "--prompt-len", "8", "--new-tokens", "3", "--batch-size",
                 "2", "--precision", "fp32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    same = estimate_generate(_llama(2), prompt_len=8, new_tokens=3, batch_size=2, precision="fp32")
    assert data["peak_bytes"] == same.peak_bytes and data["settings"]["workload"] == "generate"
    assert main(["estimate", llama_json, "--generate", "--prompt-len", "8", "--new-tokens", "3", "--cache", "static",
                 "--full"]) == 0
    assert "generate 1 x (8 prompt + 3 new) tokens, static cache" in capsys.readouterr().out


@pytest.mark.parametrize("flags, words", [
    (["--generate", "--prompt-len", "8", "--new-tokens", "3", "--seq-len", "16"], "--seq-len and --generate conflict"),
    (["--generate", "--prompt-len", "8", "--new-tokens", "3", "--optimizer", "sgd"], "--optimizer and --generate"),
    (["--generate", "--prompt-len", "8", "--new-tokens", "3", "--precision", "bf16-mixed"], "training recipe"),
    (["--generate", "--new-tokens", "3"], "--generate needs --prompt-len"),
    (["--prompt-len", "8"], "--prompt-len is for --generate"),
    (["--new-tokens", "8", "--cache", "static"], "--new-tokens is for --generate"),
], ids=["seq-len", "optimizer", "mixed-precision", "no-prompt-len", "prompt-len-alone", "new-tokens-alone"])
def test_cli_refuses_flags_that_do_not_combine(llama_json, capsys, flags, words):
    assert main(["estimate", llama_json, *flags]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1
