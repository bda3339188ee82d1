"""The bundled catalog: parameter counts as published, model states as the arithmetic says."""

import pytest

import memfit
from memfit.errors import MemfitError
from memfit.models.catalog import CATALOG, lookup

# Parameter counts published on the models' cards (rounded as published).
PUBLISHED = {"llama-3.1-8b": 8.03e9, "llama-3.2-1b": 1.24e9, "qwen2.5-0.5b": 0.494e9, "gemma-2-2b": 2.61e9,
             "mistral-7b": 7.24e9, "phi-3-mini": 3.82e9, "llama-2-7b": 6.74e9,
             "vit-huge": 0.632e9}  # ViT-H/14: 632M (Dosovitskiy et al. 2021, Table 1)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_published(name):
    report = memfit.estimate(name, seq_len=32)
    assert abs(report.parameters - PUBLISHED[name]) / PUBLISHED[name] < 0.01


def test_llama_fp32_adamw_model_states_are_16_bytes_per_parameter():
    report = memfit.estimate("llama-3.2-1b", seq_len=256, precision="fp32", optimizer="adamw")
    # at short sequences the peak is where weights, gradients and both moments are all live
    assert abs(report.model_state_bytes / report.parameters - 16) / 16 < 0.01


def test_every_entry_builds_and_traces():
    for name in CATALOG:
        entry = CATALOG[name]
        assert entry.task in {"causal-lm", "masked-lm", "seq2seq", "image-classification", "speech-seq2seq",
                              "image-text-to-text"}
    for name in ("t5-small", "vit-base", "bert-base", "gemma-2-2b"):
        assert memfit.estimate(name, seq_len=32).peak_bytes > 0


def test_unknown_names_suggest_the_closest():
    with pytest.raises(MemfitError, match="llama-3.1-8b"):
        lookup("llama3.1-8b")


def test_config_json_path(tmp_path):
    import transformers as tf

    tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   vocab_size=256).save_pretrained(tmp_path)
    report = memfit.estimate(str(tmp_path / "config.json"), seq_len=16)
    assert report.parameters > 0
