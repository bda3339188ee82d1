"""``plan`` across GPUs searches the mesh (issue 35, item 7): data parallel alone and FSDP2 x TP at each degree the
model's heads and a node's GPUs allow (sequence and loss parallel, as torchtitan runs TP), each candidate a per-rank
trace under the fake process group, the chosen one estimated in full."""

from __future__ import annotations

import json

import pytest

import memfit
from memfit.planner.ranks import _Point, tp_degrees, tp_seconds
from memfit.hardware.cluster import World
from memfit.models.source import resolve
from memfit.techniques.recipe import Recipe

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("mesh") / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def test_tp_degrees_divide_the_heads_and_a_node(tiny):
    source = resolve(tiny)
    assert tp_degrees(source, World(8)) == [2]  # 2 key-value heads: tp 4 and 8 do not divide them
    assert tp_degrees(resolve("llama-3.1-70b"), World(8, 4)) == [2, 4, 8]
    assert tp_degrees(resolve("llama-3.1-70b"), World(4)) == [2, 4]


def test_a_global_batch_smaller_than_the_gpus_is_planned_with_tensor_parallel(tiny):
    """2 examples a step over 4 GPUs: data parallel alone cannot use them all, dp=2 x tp=2 can; its per-rank
    memory is the full estimate's, and the reasons name the mesh and TP's collectives."""
    plans = memfit.plan(tiny, gpu="h100-sxm", gpus=4, global_batch_size=2, seq_len=32)
    best = plans.best
    assert best.recipe.tp == 2 and best.recipe.sequence_parallel and best.recipe.parallel == "fsdp"
    assert best.verified
    full = memfit.estimate(tiny, recipe=best.recipe, batch_size=2, seq_len=32, gpu="h100-sxm", gpus=4)
    assert best.device_bytes == full.device_bytes
    assert "dp=2 x tp=2" in best.reasons[0] and "TP collectives" in best.reasons[1]
    assert all(p.recipe.tp == 2 for p in plans)


def test_tp_collectives_grow_with_the_activation_and_the_degree():
    from memfit.hardware.gpus import gpu

    card = gpu("h100-sxm")
    base = Recipe(parallel="fsdp", tp=2, sequence_parallel=True, mixed_precision="bf16:fp32")
    one = tp_seconds(base, 1, 8192, 8192, 80, 1, card)
    assert one > 0
    assert tp_seconds(base, 2, 8192, 8192, 80, 1, card) == pytest.approx(2 * one)
    assert tp_seconds(base.replace(tp=8), 1, 8192, 8192, 80, 1, card) == pytest.approx(one * (7 / 8) / (1 / 2))
    assert tp_seconds(base.replace(checkpointing="blocks"), 1, 8192, 8192, 80, 1, card) == pytest.approx(1.5 * one)
    assert tp_seconds(base.replace(mixed_precision="fp16"), 1, 8192, 8192, 80, 1, card) == pytest.approx(one)
    assert tp_seconds(base.replace(mixed_precision="none"), 1, 8192, 8192, 80, 1, card) == pytest.approx(2 * one)
    assert tp_seconds(Recipe(parallel="fsdp"), 1, 8192, 8192, 80, 1, card) == 0


def test_a_shallow_copy_out_of_memory_is_out_of_memory_at_depth():
    fits = _Point(10, 10, 50, "fits", 100, 1.0)
    oom = _Point(10, 10, 90, "out_of_memory", 200, 2.0)
    deep = _Point.at(fits, oom, 2, 4, 80, budget=10_000)
    assert deep.verdict == "out_of_memory"  # though the line through them is under the budget
    assert deep.device_bytes == 50 + 40 * 39 and deep.compute == pytest.approx(1.0 + 0.5 * 78)
