"""The planner's search across GPUs with DeepSpeed's ZeRO beside FSDP2 (issue 51 item 3): the stages it tries, their
collectives' seconds, a composed prediction against the full estimate, and ``memfit plan --emit deepspeed`` choosing a
ZeRO recipe whose ds_config.json says what was estimated."""

import json

import pytest

pytest.importorskip("deepspeed", reason="pip install 'memfit[deepspeed]'")

from memfit.cli import main  # noqa: E402
from memfit.errors import MemfitError  # noqa: E402
from memfit.hardware.cluster import World  # noqa: E402
from memfit.hardware.gpus import gpu  # noqa: E402
from memfit.planner.data_parallel import comm_seconds, structures, zero_structures  # noqa: E402
from memfit.planner.plan import check_engines, plan  # noqa: E402
from memfit.techniques.recipe import Recipe  # noqa: E402

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 509, "hidden_size": 96,
         "intermediate_size": 257, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64}


def test_zero_stages_are_searched_only_where_allowed_with_the_trainers_buckets():
    card, world = gpu("h100-sxm"), World(4)
    torch_only = structures(card, world, True, "adamw")
    both = structures(card, world, True, "adamw", ("torch", "deepspeed"), hidden=4096)
    assert not any(f["parallel"].startswith("zero") for f in torch_only)
    zero = [f for f in both if f["parallel"].startswith("zero")]
    # 4 stages x checkpointing off, blocks; ZeRO-Offload's stage 2 and stage 3, blocks checkpointed
    assert both[:len(torch_only)] == torch_only and len(zero) == 10
    offloads = [f for f in zero if "offload" in f["zero"]]
    assert [(f["parallel"], f["checkpointing"]) for f in offloads] == [("zero2", "blocks"), ("zero3", "blocks")]
    assert offloads[1]["zero"].endswith("offload_optimizer=cpu,offload_param=cpu")
    assert not any("offload" in f["zero"] for f in zero_structures(card, world, True, "adamw8bit", 4096))
    assert {f["parallel"] for f in zero} == {"zero1", "zero2", "zero3"}
    assert all(f["precision"] == "bf16" and "mixed_precision" not in f for f in zero)
    # the Trainer's auto: reduce_bucket_size hidden², prefetch 0.9 hidden², persistence 10 hidden, written as numbers
    stage3 = next(f for f in zero if f["parallel"] == "zero3")
    assert stage3["zero"] == ("reduce_bucket_size=16777216,stage3_param_persistence_threshold=40960,"
                              "stage3_prefetch_bucket_size=15099494")
    assert sum("overlap_comm=true" in f["zero"] for f in zero) == 2
    # a card without bf16: DeepSpeed's fp16 section (a valid recipe: fp32 master partitions, its own loss scaling)
    fp16 = zero_structures(gpu("v100-32gb"), world, False, "adamw", 4096)
    assert {f["precision"] for f in fp16} == {"fp16"} and Recipe(**fp16[0]).precision == "fp16"
    with pytest.raises(MemfitError, match="precision=fp16 is DeepSpeed's fp16 section"):
        Recipe(precision="fp16")
    assert zero_structures(card, World(1), True, "adamw", 4096) == []  # nothing to shard alone
    assert structures(card, world, False, "adamw", ("deepspeed",), 4096) == zero_structures(card, world, False,
                                                                                            "adamw", 4096)


def test_zero_collectives_hidden_only_where_deepspeed_overlaps_them():
    card, world, params = gpu("h100-sxm"), World(8), 8_000_000_000
    ring = params * 2 * 7 / 8  # one 16-bit gather or reduce-scatter of every parameter, per rank
    per_byte = comm_seconds(Recipe(parallel="zero1", precision="bf16"), world, 1, 1, 1, card)[1] / (2 * 2 * 7 / 8)
    seconds = {name: comm_seconds(Recipe(parallel=p, precision="bf16", zero=z), world, params, 33, 4, card)
               for name, p, z in (("z1", "zero1", ""), ("z2", "zero2", ""), ("z2o", "zero2", "overlap_comm=true"),
                                  ("z3", "zero3", ""), ("z3n", "zero3", "overlap_comm=false"))}
    t = ring * per_byte
    assert seconds["z1"] == pytest.approx((0, t + t))  # reduced once a step, gathered after it: nothing hides them
    assert seconds["z2"] == pytest.approx((0, 4 * t + t))  # reduced every micro-batch, inside backward
    assert seconds["z2o"] == pytest.approx((4 * t, t))  # overlap_comm: the reductions behind backward
    assert seconds["z3"] == pytest.approx((8 * t + 4 * t, t / 33))  # prefetched gathers: one block's shows
    assert seconds["z3n"] == pytest.approx((8 * t, t / 33 + 4 * t))


def test_zero_offload_adds_the_host_links_traffic_and_the_host_step():
    """ZeRO-Offload's seconds a step (planner/data_parallel.py): each micro-batch's fp32 gradient partition to the host,
    the updated 16-bit one back, AdamW on the host, and with offload_param each gathered partition from it twice a
    micro-batch; none without offload."""
    from memfit.planner.data_parallel import ADAMW_BYTES, HOST_STEP_BANDWIDTH, offload_seconds

    card, world, params = gpu("h100-sxm"), World(8), 8_000_000_000
    share = params / 8
    link = offload_seconds(Recipe(parallel="zero2", precision="bf16", zero="offload_optimizer=cpu"), world, 8, 1,
                           card) - 8 / 8 * ADAMW_BYTES / HOST_STEP_BANDWIDTH  # seconds of 6 bytes over the link
    per_byte = link / 6
    two = offload_seconds(Recipe(parallel="zero2", precision="bf16", zero="offload_optimizer=cpu"), world, params, 4,
                          card)
    assert two == pytest.approx((4 * 4 + 2) * share * per_byte + share * ADAMW_BYTES / HOST_STEP_BANDWIDTH)
    three = offload_seconds(Recipe(parallel="zero3", precision="bf16", zero="offload_optimizer=cpu,offload_param=cpu"),
                            world, params, 4, card)
    assert three == pytest.approx(two + 2 * 4 * 2 * share * per_byte)
    assert offload_seconds(Recipe(parallel="zero2", precision="bf16"), world, params, 4, card) == 0


def test_engines_are_named():
    assert check_engines("deepspeed,torch") == ("torch", "deepspeed") == check_engines(["deepspeed", "torch"])
    for bad in ("megatron", "", (), 3, ("torch", None)):
        with pytest.raises(MemfitError, match="not a set of data-parallel engines"):
            check_engines(bad)
    with pytest.raises(MemfitError, match="gpus=2 or more"):
        plan("llama-3.2-1b", gpu="h100-sxm", engines=("deepspeed",))


def test_a_composed_zero_prediction_is_its_full_estimate(tmp_path):
    """A deep model is traced at 2 and 4 blocks and composed at its depth (``_Point.at``): for stage 2 with its second
    bucket (overlap_comm), against the full per-rank estimate of the same recipe."""
    from memfit.estimator.estimate import estimate
    from memfit.models.source import resolve
    from memfit.planner.search import RankSearch

    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(LLAMA, num_hidden_layers=8)))
    source, card = resolve(str(path)), gpu("rtx-4090")
    search = RankSearch(source, target=card, budget_bytes=card.memory_bytes, world=World(2), global_batch_size=4,
                        seq_len=32, optimizer="adamw")
    assert search.depths == (2, 4)
    fields = next(f for f in zero_structures(card, World(2), True, "adamw", 96) if "overlap" in f["zero"])
    recipe, point, traced = search.trace(dict(fields, checkpointing="blocks"), 1, 2)
    full = estimate(source, recipe=recipe.replace(grad_accum_steps=traced), batch_size=2 * traced, seq_len=32,
                    gpu=card, gpus=2)
    assert point.peak_bytes == pytest.approx(full.peak_bytes, rel=0.015)


def test_emit_deepspeed_plans_zero_and_writes_what_was_estimated(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    # a row a rank: one micro-batch size to try, one trace a structure
    code = main(["plan", str(path), "--gpu", "rtx-4090", "--gpus", "2", "--batch-size", "2", "--seq-len", "32",
                 "--emit", "deepspeed", "--emit-dir", str(tmp_path), "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    chosen = Recipe.from_dict(out["best"]["recipe"])
    assert chosen.parallel in ("zero1", "zero2", "zero3") and out["best"]["verified"]
    assert all(p["recipe"]["parallel"].startswith("zero") for p in out["fitting"])  # --emit deepspeed: ZeRO alone
    assert any("DeepSpeed ZeRO searched alone" in n for n in out["notes"])
    written = json.loads((tmp_path / "ds_config.json").read_text())
    assert written["zero_optimization"]["stage"] == int(chosen.parallel[-1])
    assert written["zero_optimization"]["reduce_bucket_size"] == 96 * 96  # hidden², as estimated
    assert written["train_micro_batch_size_per_gpu"] * written["gradient_accumulation_steps"] * 2 == 2


def test_engine_flag_in_one_line(capsys):
    assert main(["plan", "llama-3.2-1b", "--gpu", "h100-sxm", "--gpus", "2", "--engine", "megatron"]) == 2
    err = capsys.readouterr().err
    assert "--engine 'megatron' is not a data-parallel engine" in err and len(err.strip().splitlines()) == 1
