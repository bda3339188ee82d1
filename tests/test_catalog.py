"""The bundled catalog: parameter counts as published, model states as the arithmetic says."""

import pytest

import memfit
from memfit.errors import MemfitError
from memfit.models import counts
from memfit.models.catalog import CATALOG, lookup
from memfit.models.source import resolve

# Parameter counts published on the models' cards (rounded as published).
PUBLISHED = {"llama-3.1-8b": 8.03e9, "llama-3.2-1b": 1.24e9, "qwen2.5-0.5b": 0.494e9, "gemma-2-2b": 2.61e9,
             "mistral-7b": 7.24e9, "phi-3-mini": 3.82e9, "llama-2-7b": 6.74e9,
             "vit-huge": 0.632e9}  # ViT-H/14: 632M (Dosovitskiy et al. 2021, Table 1)


def test_parameter_counts_match_published():
    """The counts of a meta build (configs/_counts.json, checked against fresh builds below); that an
    estimate's ``report.parameters`` is that count is the next test's."""
    for name, published in PUBLISHED.items():
        assert abs(counts.table()[name].params - published) / published < 0.01, name


def test_llama_fp32_adamw_model_states_are_16_bytes_per_parameter():
    report = memfit.estimate("llama-3.2-1b", seq_len=256, precision="fp32", optimizer="adamw")
    assert report.method == "depth"  # the 4-block copy's parameters counted once per block it is written as
    assert report.parameters == counts.table()["llama-3.2-1b"].params
    # at short sequences the peak is where weights, gradients and both moments are all live
    assert abs(report.model_state_bytes / report.parameters - 16) / 16 < 0.01


def test_every_entry_builds_and_traces():
    """Every entry's task is one memfit makes batches for; a 2-block copy of one entry per kind of model
    (encoder-decoder, vision, encoder, decoder with sliding and global layers) is estimated, as traced
    at full width: their depth is the depth fast path's (tests/test_depth.py, test_catalog_layers.py)."""
    for name in CATALOG:
        entry = CATALOG[name]
        assert entry.task in {"causal-lm", "masked-lm", "seq2seq", "image-classification", "speech-seq2seq",
                              "image-text-to-text"}
    import torch

    for name in ("t5-small", "vit-base", "bert-base", "gemma-2-2b"):
        source = resolve(name).shallow(2)
        report = memfit.estimate(source, seq_len=32)
        assert report.peak_bytes > 0 and report.method == "fake"
        with torch.device("meta"):
            assert report.parameters == counts.count_module(source.build()).params
        assert report.parameters < counts.table()[name].params  # two blocks (of each stack) of the entry's


def test_unknown_names_suggest_the_closest():
    with pytest.raises(MemfitError, match="llama-3.1-8b"):
        lookup("llama3.1-8b")


def test_config_json_path(tmp_path):
    import transformers as tf

    tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   vocab_size=256).save_pretrained(tmp_path)
    report = memfit.estimate(str(tmp_path / "config.json"), seq_len=16)
    assert report.parameters > 0


# --- the current catalog (issue 23): one config file per entry in memfit/models/configs ---------------

from memfit.models.catalog import CONFIGS  # noqa: E402

FILED = sorted(path.stem for path in CONFIGS.glob("*.json") if not path.name.startswith("_"))


def _published_total(name):
    """memfit's count of what the card counts: the text model, plus the vision tower where the card's
    total is of the multimodal model (``published_with``)."""
    entry = CATALOG[name]
    extra = entry.published.get("published_with")
    if extra is None:
        return counts.table()[name].params
    return counts.count(extra["model_type"], {"text_config": entry.config, "vision_config": extra["vision_config"]},
                        "image-text-to-text").params


def test_the_current_catalog_is_filed():
    assert len(FILED) >= 15
    for name in FILED:
        entry = CATALOG[name]
        assert entry.source and entry.family and entry.published["published_params"] > 0, name


def test_stored_counts_are_fresh_builds():
    """configs/_counts.json (what ``memfit models`` prints) is what a meta build counts now: it
    cannot go stale (regenerate with ``python -m memfit.models.counts``)."""
    assert counts.table() == counts.fresh()


@pytest.mark.parametrize("name", FILED)
def test_filed_parameter_counts_match_the_card(name):
    published = CATALOG[name].published["published_params"]
    assert abs(_published_total(name) - published) / published < 0.01


ACTIVE = [name for name in FILED if "published_active_params" in CATALOG[name].published]


@pytest.mark.parametrize("name", ACTIVE)
def test_active_parameters_match_the_card(name):
    """Outside the routed experts + top_k/experts of them, as the publisher counts (some leave
    embeddings out: ``published_active_excludes``)."""
    entry = CATALOG[name]
    exclude = tuple(entry.published.get("published_active_excludes", ()))
    active = counts.count(entry.model_type, entry.config, entry.task, exclude).active
    published = entry.published["published_active_params"]
    assert abs(active - published) / published < 0.025


def test_moe_entries_have_an_active_count_and_dense_ones_none():
    stored = counts.table()
    assert {"deepseek-v3", "qwen3-235b-a22b", "gpt-oss-20b", "llama-4-scout"} <= {
        n for n, c in stored.items() if c.active is not None}
    assert stored["qwen3-8b"].active is None and stored["gemma-3-27b"].active is None


def test_models_filters_and_columns(capsys):
    from memfit.cli import main

    assert main(["models", "--family", "qwen", "--max-params", "10B"]) == 0
    out = capsys.readouterr().out
    assert "qwen3-8b" in out and "qwen2.5-7b" in out and "qwen3-14b" not in out and "llama" not in out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert main(["models", "--json", "--max-params", "7e9"]) == 0
    import json

    listed = json.loads(capsys.readouterr().out)
    assert all(v["params"] <= 7e9 for v in listed.values()) and "qwen3-4b" in listed
    assert main(["models", "--json", "--family", "deepseek"]) == 0
    assert json.loads(capsys.readouterr().out)["deepseek-v3"]["active_params"] > 3e10


@pytest.mark.parametrize("args, message", [(["--max-params", "ten"], "10B"), (["--family", "nope"], "gemma3")])
def test_models_bad_filters_name_the_fix(args, message, capsys):
    from memfit.cli import main

    assert main(["models", *args]) != 0
    assert message in capsys.readouterr().err
