"""Pipeline parallelism (issue 35, item 2): ``Recipe(pp=N)`` cuts a Hugging Face decoder into N stages as torchtitan
cuts them and runs ``torch.distributed.pipelining``'s GPipe or 1F1B schedule; every stage is its own kind of rank
(its blocks, the micro-batches it keeps in flight), each estimated under the fake process group and graded against
a real ``torchrun`` run over gloo by that rank's own allocator events (``memfit.distributed.truth``)."""

from __future__ import annotations

import json

import pytest

import _truths
import memfit
from memfit.errors import MemfitError
from memfit.techniques.pipeline_parallel import cut
from memfit.techniques.recipe import Recipe

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 176, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("pp") / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


@pytest.fixture(scope="module")
def shallow(tmp_path_factory):
    """``TINY`` at 2 blocks, one a stage: for what needs every stage traced but not many blocks in it."""
    path = tmp_path_factory.mktemp("pp-shallow") / "config.json"
    path.write_text(json.dumps(dict(TINY, num_hidden_layers=2)))
    return str(path)


def _estimate(path, recipe, gpus, batch=4):
    world = gpus if isinstance(gpus, dict) else {"gpus": gpus}
    return memfit.estimate(path, batch_size=batch, seq_len=32, recipe=Recipe(**recipe), device="cpu", **world)


TRUTHS = [  # every case a 2-rank truth, run in the session's one torchrun (tests/_truths.py)
    # GPipe: every micro-batch's activations live at the turn; with autocast and checkpointed blocks
    {"pp": 2, "pp_schedule": "gpipe", "micro_batch_size": 1, "grad_accum_steps": 4, "precision": "bf16-mixed",
     "checkpointing": "blocks"},
    # FSDP2 on each stage (the (pp, dp) mesh, here dp=1: its gathers and frees, not yet its sharding); 1F1B. Each stage
    # sharded over 2 data-parallel ranks needs 4: `python -m bench distributed --only pp-2-fsdp-2-1f1b`
    {"pp": 2, "parallel": "fsdp", "micro_batch_size": 1, "grad_accum_steps": 4},
    # Interleaved 1F1B: 4 stages, two a rank (0 and 2, 1 and 3). 4 stages over 4 ranks with 1F1B, and interleaved
    # with FSDP2 (each stage its own root): bench/distributed/distributed.py (2 ranks here keep the suite's time)
    {"pp": 2, "pp_schedule": "interleaved-1f1b", "micro_batch_size": 1, "grad_accum_steps": 4},
]


_truths.register("pipeline_parallel", [(TINY, {"recipe": recipe, "batch_size": 4, "seq_len": 32, "steps": 2})
                                       for recipe in TRUTHS])


@pytest.fixture(scope="module")
def truths(tmp_path_factory):
    """Every case of ``TRUTHS`` run for real on 2 ranks (4 rows a step; with the other modules' in one torchrun): per
    case, each rank's result."""
    return _truths.results(tmp_path_factory, "pipeline_parallel")


@pytest.mark.parametrize("case", range(len(TRUTHS)), ids=["gpipe", "fsdp", "interleaved"])
def test_pipeline_matches_torchrun_on_every_stage(tiny, truths, case):
    recipe, gpus, batch = TRUTHS[case], 2, 4
    report = _estimate(tiny, recipe, gpus, batch=batch)
    truths = truths[case]
    estimated = {r["rank"]: r for r in report.ranks}
    dp = gpus // recipe["pp"]
    # every stage traced (each is its own kind of rank), its first data-parallel rank standing for the others
    assert sorted(estimated) == [stage * dp for stage in range(recipe["pp"])]
    for truth in truths:
        mine = estimated[truth["rank"] - truth["rank"] % dp]
        assert abs(mine["peak_bytes"] - truth["peak_bytes"]) <= 64, truth["rank"]
        for phase in ("forward", "backward"):
            assert abs(mine["phase_peaks"][phase] - truth["phase_peaks"][f"{phase}:1"]) <= 64, (truth["rank"], phase)
    assert report.peak_bytes == max(r["peak_bytes"] for r in report.ranks)
    assert report.world["pp"] == recipe["pp"]


def test_pipeline_with_tensor_parallel_traces_each_stage(shallow):
    """PP x TP on one (pp, tp) mesh, torchtitan's order: both stages traced, each by its first rank (its TP peer holds
    the same). Against torchrun this needs 4 ranks: `python -m bench distributed --only pp-2-tp-2-sequence-loss`
    (each stage exact on one TP rank, the other within 0.5 %); the suite keeps to 2-rank truths for its time. A block
    a stage is enough to show both stages traced (the 6-block model's 3 a stage cost 3 times as much)."""
    recipe = {"pp": 2, "tp": 2, "sequence_parallel": True, "loss_parallel": True, "micro_batch_size": 1,
              "grad_accum_steps": 2}
    report = _estimate(shallow, recipe, 4, batch=2)
    assert sorted(r["rank"] for r in report.ranks) == [0, 2]
    assert report.world["pp"] == 2 and report.world["tp"] == 2
    assert "pp=2 x tp=2" in " ".join(report.notes)
    assert report.peak_bytes == max(r["peak_bytes"] for r in report.ranks)


def test_stages_are_cut_as_torchtitan_cuts_them():
    # torchtitan's rule (generate_llm_fqn_per_model_part): 32 blocks + embedding + head = 34 over 8 stages is 4
    # each and 2 over, which go to the first two stages; the first and last give one to embedding and head
    assert [len(r) for r in cut(32, 8)] == [4, 5, 4, 4, 4, 4, 4, 3]
    assert [len(r) for r in cut(27, 4)] == [7, 7, 7, 6]
    assert [(r.start, r.stop) for r in cut(6, 4)] == [(0, 1), (1, 3), (3, 5), (5, 6)]
    with pytest.raises(MemfitError, match="more stages"):
        cut(4, 8)


def test_1f1b_keeps_fewer_micro_batches_than_gpipe(shallow):
    # one block a stage: GPipe holds all 4 micro-batches' activations at the turn, 1F1B at most 2 on the first stage
    recipe = {"pp": 2, "micro_batch_size": 1, "grad_accum_steps": 4}
    one = _estimate(shallow, recipe, 2)
    gpipe = _estimate(shallow, {**recipe, "pp_schedule": "gpipe"}, 2)
    assert one.peak_bytes < gpipe.peak_bytes
    # parameters and optimizer state as cut: the stage's own, the same whichever schedule runs them
    assert [r["by_category"]["parameters"] for r in one.ranks] == [r["by_category"]["parameters"] for r in gpipe.ranks]


@pytest.mark.parametrize("recipe, gpus, words", [
    ({"pp": 2}, None, "--gpus 2"),
    ({"pp": 2}, 4, "parallel=fsdp"),
    ({"pp": 2, "tp": 2}, 6, "does not divide"),
    ({"pp": 4}, {"gpus": 4, "nodes": 3}, "split the nodes evenly"),
    ({"pp": 2, "parallel": "ddp"}, 4, "conflict"),
    ({"pp_schedule": "gpipe"}, None, "needs pipeline parallelism"),
    ({"pp": 0}, 2, "pp must be"),
    ({"pp": 2}, 2, "--grad-accum-steps 2"),
    ({"pp": 2, "parallel": "fsdp", "sync_grads": "every"}, 4, "last backward only"),
    ({"pp": 2, "pp_schedule": "interleaved-1f1b", "micro_batch_size": 1, "grad_accum_steps": 5}, 2, "rounds of 2"),
    ({"pp": 8, "micro_batch_size": 1, "grad_accum_steps": 8}, 8, "more stages"),
])
def test_bad_pipeline_is_one_line(tiny, recipe, gpus, words):
    with pytest.raises(MemfitError) as err:
        rows = recipe["micro_batch_size"] * recipe["grad_accum_steps"] if "micro_batch_size" in recipe else 4
        _estimate(tiny, recipe, gpus, batch=rows)
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("recipe, gpus, written", [
    # 3 micro-batches: 1F1B's first stage has its warm-up (2 forwards), one steady forward-backward and its drain
    ({"pp": 2, "micro_batch_size": 1, "grad_accum_steps": 3}, 2, True),
    ({"pp": 2, "pp_schedule": "gpipe", "precision": "bf16-mixed", "micro_batch_size": 1, "grad_accum_steps": 3}, 2,
     True),
    # torchtitan's 405B layout in small: 1F1B over FSDP2 with the bf16 policy and checkpointed blocks. The stage's
    # last block gathers its own weights in backward beside the prefetch for the block below, so its records stand
    # two apart from the middle block's: the written log finds each record's counterpart (synth.py's _Roles)
    ({"pp": 2, "parallel": "fsdp", "mixed_precision": "bf16", "checkpointing": "blocks", "micro_batch_size": 1,
      "grad_accum_steps": 3}, 4, True),
])
def test_a_stage_takes_the_depth_fast_path(write_config, recipe, gpus, written):
    """Each stage traced as a shallow copy of its blocks (4 of the stage's 5: blocks 0-4 and the embedding, blocks
    5-9 and the head), its log written out at the stage's depth, equals the stage traced in full, but for 4 bytes on
    the first stage (one 4-byte optimizer counter is the copy's: under CUDA semantics the caching allocator's
    figures are equal, its 512-byte rounding absorbing it). 5 blocks a stage (not 7) and 3 micro-batches (not 4)
    keep every pattern at about half the suite's time."""
    path = write_config(dict(TINY, num_hidden_layers=10))
    batch = gpus // 2 * recipe["grad_accum_steps"]
    full, fast = (memfit.estimate(path, batch_size=batch, seq_len=32, recipe=Recipe(**recipe), gpus=gpus, fast=f,
                                  device="cpu") for f in (False, True))
    assert [r["rank"] for r in fast.ranks] == [r["rank"] for r in full.ranks]
    for mine, whole in zip(fast.ranks, full.ranks):
        assert 0 <= whole["peak_bytes"] - mine["peak_bytes"] <= 4
        assert all(0 <= whole["phase_peaks"][p] - mine["phase_peaks"][p] <= 4 for p in whole["phase_peaks"])
    assert any("of the stage's 5 blocks" in n for n in fast.notes) == written


def test_a_stage_on_the_fast_path_reserves_what_its_full_trace_reserves(write_config):
    """Under CUDA semantics at sizes where the caching allocator's segments tell orders apart: at a stage's last
    backward the root reduce-scatters its blocks in turn, each freeing the one before's buffer; written with the
    freed weights of all blocks first (the written log's old order) the allocated peak was equal and a stage
    reserved 222 MB more than its full trace (4 stages of this model at tp=1, dp=2)."""
    path = write_config(dict(TINY, hidden_size=2048, intermediate_size=5632, num_attention_heads=16,
                             num_key_value_heads=8, vocab_size=32000, num_hidden_layers=12))
    recipe = Recipe(pp=2, parallel="fsdp", mixed_precision="bf16:fp32", checkpointing="blocks", micro_batch_size=1,
                    grad_accum_steps=2)
    full, fast = (memfit.estimate(path, batch_size=4, seq_len=4096, recipe=recipe, gpus=4, fast=f, gpu="h200")
                  for f in (False, True))
    assert any("of the stage's" in n for n in fast.notes)
    for mine, whole in zip(fast.ranks, full.ranks):
        assert mine["device_bytes"] == whole["device_bytes"]
        assert 0 <= whole["peak_bytes"] - mine["peak_bytes"] <= 512


def test_a_looped_schedule_is_traced_in_full(tiny):
    recipe = {"pp": 2, "pp_schedule": "interleaved-1f1b", "micro_batch_size": 1, "grad_accum_steps": 4}
    with pytest.raises(MemfitError, match="traced in full") as err:
        memfit.estimate(tiny, batch_size=4, seq_len=32, recipe=Recipe(**recipe), gpus=2, fast=True)
    assert "\n" not in str(err.value)
