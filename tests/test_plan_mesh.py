"""``plan`` across GPUs searches the mesh (issue 35, item 7): data parallel alone and FSDP2 x TP at each degree the
model's heads and a node's GPUs allow (sequence and loss parallel, as torchtitan runs TP), each candidate a per-rank
trace under the fake process group, the chosen one estimated in full."""

from __future__ import annotations

import json

import pytest

import memfit
from memfit.planner.ranks import tp_degrees, tp_seconds
from memfit.planner.search import _Point
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


def test_the_phase_that_peaks_deep_is_composed_on_its_own():
    # qwen3-30b-a3b, FSDP2 x EP4 over 8 H100s, seq 4096, checkpointed (GiB, memfit estimate at 2 and 4 blocks): the
    # shallow copies peak in backward, the 48-block model in the optimizer step (full estimate: 71.15 allocated)
    G = 2**30
    low = _Point(int(10.919 * G), int(16.029 * G), int(16.529 * G), "fits", 1, 1.0,
                 phases=(("backward", int(10.919 * G)), ("forward", int(10.005 * G)), ("optimizer", int(4.413 * G))))
    high = _Point(int(12.691 * G), int(17.195 * G), int(17.695 * G), "fits", 1, 1.0,
                  phases=(("backward", int(12.691 * G)), ("forward", int(11.777 * G)), ("optimizer", int(7.315 * G))))
    deep = _Point.at(low, high, 2, 4, 48, budget=80 * G)
    assert deep.peak_bytes / G == pytest.approx(71.15, abs=0.01)  # the optimizer's line, not backward's (51.7)
    assert deep.device_bytes >= deep.peak_bytes + 5.0 * G  # and the allocator's bytes above it (full: 78.05)


MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
       "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 256,
       "max_position_embeddings": 256}


def test_expert_parallel_is_searched_for_a_mixture_of_experts(tmp_path):
    pytest.importorskip("transformers.distributed.expert_parallel")
    from memfit.planner.mesh import ep_degrees, ep_seconds
    from memfit.hardware.gpus import gpu

    assert ep_degrees(resolve("qwen3-30b-a3b"), World(8)) == [2, 4, 8]
    assert ep_degrees(resolve("mixtral-8x7b"), World(4, 2)) == [2, 4]  # within a node
    assert ep_degrees(resolve("llama-3.1-70b"), World(8)) == []  # no experts
    assert tp_degrees(resolve("qwen3-30b-a3b"), World(8)) == []  # its experts' TP styles: not laid out yet
    card = gpu("h100-sxm")
    one = ep_seconds(Recipe(parallel="fsdp", ep=2), 1, 4096, 2048, 48, 8, 1, card)
    assert one > 0 and ep_seconds(Recipe(parallel="fsdp", ep=8), 1, 4096, 2048, 48, 8, 1, card) == \
        pytest.approx(one * (7 / 8) / (1 / 2))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MOE))
    plans = memfit.plan(str(path), gpu="h100-sxm", gpus=4, global_batch_size=4, seq_len=32)
    assert {p.recipe.ep for p in plans} == {1, 2, 4}
    assert any("expert parallel searched at ep=2, 4" in n for n in plans.notes)
    best = plans.best
    full = memfit.estimate(str(path), recipe=best.recipe, batch_size=4, seq_len=32, gpu="h100-sxm", gpus=4)
    assert best.verified and best.device_bytes == full.device_bytes


def test_structures_over_several_nodes_also_shard_over_every_rank():
    # (tp_structures referred to a name left behind in ranks.py when it moved to mesh.py: a multi-node TP plan
    # raised NameError; nothing single-node reaches that line)
    from memfit.planner.mesh import MAX_SHARD, ep_structures, tp_structures

    two = World(8, 2)
    assert {s["shard_over"] for s in tp_structures(None, two, 8, True, "adamw")} == {"node", "world"}
    assert {s["shard_over"] for s in ep_structures(None, two, 8, True, "adamw")} == {"node", "world"}
    assert {s["shard_over"] for s in ep_structures(None, World(8, MAX_SHARD), 8, True, "adamw")} == {"node"}
    assert {s["shard_over"] for s in ep_structures(None, World(8), 8, False, "adamw")} == {"node"}


def test_pipeline_degrees_bubble_and_sends():
    """PP is searched over several nodes only, at degrees leaving each stage two blocks and each data-parallel rank
    pp rows (1F1B's micro-batches); its bubble is (pp - 1) / (m + pp - 1); its sends grow with the micro-batches
    and cross the network between nodes."""
    from memfit.hardware.gpus import gpu
    from memfit.planner.mesh import bubble, pp_degrees, pp_seconds, pp_world

    big = resolve("llama-3.1-405b")
    assert pp_degrees(big, World(8, 64), 8, 512) == [2, 4, 8]
    assert pp_degrees(big, World(8, 1), 8, 512) == []  # one node: FSDP2's collectives stay on NVLink
    assert pp_degrees(big, World(8, 2), 8, 1) == []  # one row for two data-parallel ranks
    assert pp_degrees(resolve("llama-3.2-1b"), World(8, 64), 8, 512) == [2, 4, 8]  # 16 blocks: 2 a stage at pp 8
    assert bubble(8, 8) == pytest.approx(7 / 15) and bubble(8, 64) == pytest.approx(7 / 71) and bubble(1, 4) == 0
    assert pp_world(World(8, 64), 8, 8) == World(1, 8) and pp_world(World(8, 4), 2, 2) == World(4, 2)
    card = gpu("h100-sxm")
    recipe = Recipe(parallel="fsdp", tp=8, sequence_parallel=True, pp=8, micro_batch_size=1, grad_accum_steps=8,
                    mixed_precision="bf16:fp32", checkpointing="blocks")
    one = pp_seconds(recipe, 1, 8192, 16384, card, between_nodes=True)
    assert one == pytest.approx(2 * 8 * 8192 * 16384 * 2 / 8 / (50e9 * 0.8))
    assert pp_seconds(recipe.replace(grad_accum_steps=16), 1, 8192, 16384, card, True) == pytest.approx(2 * one)
    assert pp_seconds(recipe, 1, 8192, 16384, card, between_nodes=False) < one
    assert pp_seconds(Recipe(), 1, 8192, 16384, card, True) == 0


def _count_traces(monkeypatch) -> list:
    """The per-rank fake traces a plan's search runs (``RankSearch._trace_kernels``), each its recipe."""
    from memfit.planner.search import RankSearch

    runs, trace = [], RankSearch._trace_kernels

    def counted(self, model, recipe, micro, traced):
        runs.append(recipe)
        return trace(self, model, recipe, micro, traced)

    monkeypatch.setattr(RankSearch, "_trace_kernels", counted)
    return runs


def test_a_pipeline_is_searched_over_nodes(write_config, monkeypatch):
    """Over two nodes FSDP2 x PP (1F1B) is a candidate: its per-rank memory is the full estimate of every stage at
    pp micro-batches (here all of them), its step time has the bubble in it. 4 blocks: the fewest pp=2 takes (two a
    stage, ``pp_degrees``); 6 traced each of the 12 structures and the stages deeper for nothing more (a third of
    this file's time)."""
    path = write_config(dict(TINY, num_hidden_layers=4))
    runs = _count_traces(monkeypatch)
    plans = memfit.plan(path, gpu="h100-sxm", gpus=1, nodes=2, global_batch_size=2, seq_len=32)
    assert plans.settings["pp_degrees"] == [2]
    # 12 data-parallel structures, one trace each (one row a rank); the pipeline's flat kernels (the whole model on
    # its mesh, one row) are the checkpointed FSDP2-over-every-rank structure's trace, not run again
    assert plans.settings["traces"] == 13 and len(runs) == 12 and len(set(runs)) == 12
    assert any("pipeline parallel searched at pp=2" in n for n in plans.notes)
    staged = [p for p in plans if p.recipe.pp == 2]
    assert len(staged) == 1
    plan = staged[0]
    assert plan.recipe.pp_schedule == "1f1b" and plan.recipe.grad_accum_steps == 2 and plan.recipe.micro_batch_size == 1
    full = memfit.estimate(path, recipe=plan.recipe, batch_size=2, seq_len=32, gpu="h100-sxm", gpus=1, nodes=2)
    assert plan.device_bytes == full.device_bytes


def test_context_parallel_is_searched_for_long_sequences(tiny):
    """At CP_FROM tokens FSDP2 x CP is a candidate (CP peers read the same rows, so 2 rows fill 4 GPUs); its
    ring's collectives grow with the keys' width and the degree; shorter sequences do not search it."""
    from memfit.hardware.gpus import gpu
    from memfit.planner.mesh import CP_FROM, cp_degrees, cp_seconds

    source = resolve(tiny)
    assert cp_degrees(source, World(4), CP_FROM, 2) == [2, 4]  # cp=4: one data-parallel rank reads both rows
    assert cp_degrees(source, World(4), CP_FROM, 1) == [4]  # cp=2: two data-parallel ranks do not split one row
    assert cp_degrees(source, World(4), CP_FROM // 2, 2) == []
    assert cp_degrees(resolve("llama-3.1-8b"), World(8, 2), 32768, 16) == [2, 4, 8]
    card = gpu("h100-sxm")
    ring = Recipe(parallel="fsdp", cp=2, mixed_precision="bf16:fp32")
    one = cp_seconds(ring, 1, 32768, 1024, 32, 1, card)
    assert one == pytest.approx(32 * 3 * 2 * 32768 * 1024 * 2 * (1 / 2) / (450e9 * 0.8))
    assert cp_seconds(ring.replace(cp=8), 1, 32768, 1024, 32, 1, card) == pytest.approx(one * (7 / 8) / (1 / 2))
    assert cp_seconds(ring.replace(checkpointing="blocks"), 1, 32768, 1024, 32, 1, card) == pytest.approx(one * 4 / 3)
    assert cp_seconds(Recipe(parallel="fsdp"), 1, 32768, 1024, 32, 1, card) == 0
    plans = memfit.plan(tiny, gpu="h100-sxm", gpus=4, global_batch_size=2, seq_len=CP_FROM)
    assert plans.settings["cp_degrees"] == [2, 4]
    rings = [p for p in plans if p.recipe.cp > 1]
    assert rings and all(p.recipe.parallel == "fsdp" and p.recipe.tp == 1 for p in rings)


def test_a_budget_below_what_is_outside_the_allocator_traces_nothing(tiny, monkeypatch):
    """A rank that holds the budget or more outside torch's allocator (the CUDA context, the step's kernels, its NCCL
    communicators: 1068 MiB for DDP over 2 RTX 4090s, cuBLAS left out) is out of memory at every micro-batch: no
    structure is traced, and the answer is the one the traces gave (each 1226 MiB a rank, all out of memory)."""
    from memfit.estimator.verdict import run_outside
    from memfit.hardware.gpus import gpu

    runs = _count_traces(monkeypatch)
    with pytest.raises(memfit.NothingFits, match="every structure is over budget at micro-batch 1"):
        memfit.plan(tiny, gpu="rtx-4090", budget="700MiB", gpus=2, global_batch_size=2, seq_len=32)
    assert runs == []
    card = gpu("rtx-4090")
    least = run_outside(card, Recipe(parallel="ddp"), 2, matmul=False).bytes
    assert 700 * 2**20 <= least < run_outside(card, Recipe(parallel="ddp"), 2).bytes


def test_a_shallow_copy_out_of_memory_is_not_traced_deeper(write_config, monkeypatch):
    """A deep model's candidate is traced at 2 blocks first: out of memory there, it is out of memory at depth
    (``_Point.at``), and the 4-block copy is not traced; fitting there, both are."""
    from memfit.hardware.gpus import gpu
    from memfit.planner.search import RankSearch

    source = resolve(write_config(dict(TINY, num_hidden_layers=8)))
    search = RankSearch(source, target=gpu("h100-sxm"), budget_bytes=2**30, world=World(2), global_batch_size=2,
                        seq_len=32, optimizer="adamw")
    assert search.depths == (2, 4)
    asked, verdicts = [], {}

    def one(depth, recipe, micro, traced):
        asked.append(depth)
        return _Point(10, 10, 50 * depth, verdicts[depth], 100, 1.0, phases=(("backward", 10),))

    monkeypatch.setattr(search, "_one", one)
    verdicts.update({2: "out_of_memory", 4: "out_of_memory"})
    recipe, point, traced = search.trace({"parallel": "fsdp"}, 1, 1)
    assert asked == [2] and point.verdict == "out_of_memory"
    verdicts.update({2: "fits", 4: "fits"})
    asked.clear()
    assert search.trace({"parallel": "fsdp"}, 1, 1)[1].verdict == "fits" and asked == [2, 4]
