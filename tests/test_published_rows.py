"""bench/published.py: the quoted rows are well-formed, and its restated losses are the same loss."""

import os
import sys

import pytest
import torch
import transformers as tf

BENCH = os.path.join(os.path.dirname(__file__), "..", "bench")
sys.path.insert(0, BENCH)

import published  # noqa: E402
from published_rows import EXCLUDED, ROWS  # noqa: E402
from memfit.models.catalog import CATALOG  # noqa: E402
from memfit.techniques.registry import fields  # noqa: E402

# Recipe fields being built beside the bench; a row may name them before the tree has them.
PENDING = {"compile", "activation_memory_budget", "lora_targets", "lora_alpha", "lora_dropout", "offload_gradients"}


def test_rows_are_quoted_and_mapped():
    ids = [r["id"] for r in ROWS] + [r["id"] for r in EXCLUDED]
    assert len(ids) == len(set(ids))
    known = {f.name for f in fields()} | PENDING
    for row in ROWS:
        assert f"{row['value']:g}" in row["quote"].replace(",", ""), row["id"]  # the figure is the quoted one
        assert row["unit"] in published.UNITS and row["metric"] in published.FIGURE, row["id"]
        assert row["model"] in CATALOG, row["id"]
        assert set(row["recipe"]) <= known, row["id"]
        assert row["source"].startswith("https://github.com/") and len(row["commit"]) == 40, row["id"]
        assert row["note"], row["id"]
    assert len(ROWS) >= 25


def _tiny():
    torch.manual_seed(0)
    config = tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                            vocab_size=96)
    model = tf.AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 96, (2, 24))
    return model, {"input_ids": ids, "labels": ids.clone()}


@pytest.mark.parametrize("loss", [published.torchtune_loss(0), published.torchtune_loss(4),
                                  published.litgpt_loss(7)], ids=["torchtune-plain", "torchtune-chunked", "litgpt"])
def test_restated_losses_equal_the_models_own(loss):
    model, batch = _tiny()
    expected = model(**batch).loss  # mean next-token cross-entropy
    torch.testing.assert_close(loss(model, batch), expected, rtol=1e-5, atol=1e-6)
