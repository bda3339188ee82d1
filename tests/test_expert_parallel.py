"""Expert parallelism (issue 35, item 4): ``Recipe(ep=N)`` splits each MoE layer's experts over N ranks of the FSDP2
group with transformers' expert plan and its all-to-all dispatch, per rank under the fake process group, against
real ``torchrun`` runs over gloo graded by each rank's allocator events (``memfit.distributed.truth``), the routers
made to choose as the estimate assumes (``expert_parallel.route``)."""

from __future__ import annotations

import functools
import json

import pytest

import _truths
import memfit
from memfit.cli import main
from memfit.errors import MemfitError
from memfit.techniques.expert_parallel import routed_sizes
from memfit.techniques.recipe import Recipe

pytest.importorskip("transformers.distributed.expert_parallel")

MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
       "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 256,
       "max_position_embeddings": 256}


@pytest.fixture(scope="module")
def moe(write_config):
    return write_config(MOE)


def _estimate(path, recipe, gpus, batch=2, routing="balanced", **kwargs):
    return memfit.estimate(path, batch_size=batch, seq_len=32, recipe=Recipe(**recipe), gpus=gpus, device="cpu",
                           moe_routing=routing, **kwargs)


@functools.cache
def _ep2(path, routing):
    """ep=2 over 2 ranks (2 steps), one estimate per routing for the module: the truths and the routing test read it."""
    return _estimate(path, {"parallel": "fsdp", "ep": 2}, 2, routing=routing, steps=2)


ROUTINGS = ("balanced", "worst")


_truths.register("expert_parallel", [(MOE, {"recipe": {"parallel": "fsdp", "ep": 2}, "batch_size": 2, "seq_len": 32,
                                            "steps": 2, "moe_routing": routing}) for routing in ROUTINGS])


@pytest.fixture(scope="module")
def truths(tmp_path_factory):
    """ep=2 run for real on 2 ranks under each routing (with the other modules' in one torchrun): per routing, each
    rank's result."""
    return dict(zip(ROUTINGS, _truths.results(tmp_path_factory, "expert_parallel")))


@pytest.mark.parametrize("routing", ROUTINGS)
def test_expert_parallel_matches_torchrun(moe, truths, routing):
    truths = truths[routing]
    report = _ep2(moe, routing)
    peaks = [t["peak_bytes"] for t in truths]
    if routing == "balanced":
        assert peaks[0] == peaks[1]  # each rank receives as many pairs as it sends
    else:  # every token on rank 0's experts: rank 0 receives both ranks' pairs, the estimate is that rank
        assert peaks[0] > peaks[1] and "EP rank 0" in " ".join(report.notes)
    assert report.world["rank"] == 0 and report.world["ep"] == 2
    assert abs(report.peak_bytes - peaks[0]) <= 64
    for phase in ("forward", "backward"):
        assert abs(report.phase_peaks[phase] - truths[0]["phase_peaks"][f"{phase}:1"]) <= 64, phase


def test_worst_routing_holds_more_and_the_experts_are_split(moe):
    balanced, worst = _ep2(moe, "balanced"), _ep2(moe, "worst")
    assert worst.peak_bytes > balanced.peak_bytes
    # FSDP2 alone gathers each layer's whole experts; with ep=2 a rank holds only its own half
    alone = _estimate(moe, {"parallel": "fsdp"}, 2)
    assert alone.peak_bytes > balanced.peak_bytes


def test_the_routing_splits_the_pairs_as_the_truth_runs_route_them():
    # 16 tokens, top-2 of 4 experts over 2 ranks: balanced sends 16 pairs each way; worst sends all 32 to rank 0
    assert routed_sizes(16, 2, 4, 2, 0, "balanced") == [[16, 16], [16, 16]]
    assert routed_sizes(16, 2, 4, 2, 0, "worst") == [[32, 0], [32, 32]]
    assert routed_sizes(16, 2, 4, 2, 1, "worst") == [[32, 0], [0, 0]]


def test_expert_parallel_takes_the_depth_fast_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(MOE, num_hidden_layers=5)))  # 4 blocks traced (0, 1, 2, 4), block 3 written out
    recipe = {"parallel": "fsdp", "ep": 2, "precision": "bf16-mixed"}
    full, fast = (_estimate(str(path), recipe, 4, batch=4, routing="worst", fast=f) for f in (False, True))
    assert fast.peak_bytes == full.peak_bytes and fast.phase_peaks == full.phase_peaks
    assert any("traced 4 of 5 blocks" in n for n in fast.notes)


@pytest.mark.parametrize("flags, words", [
    (["--ep", "3"], "ep=3 does not divide the 4 rank(s)"),
    (["--ep", "2", "--parallel", "ddp"], "needs parallel=fsdp"),
    (["--ep", "8", "--gpus", "8", "--batch-size", "8"], "does not divide the model's 4 experts"),
    (["--ep", "2", "--tp", "2"], "conflict"),
    (["--ep", "2", "--gpus", "1"], "does not divide the 1 rank(s)"),
])
def test_bad_expert_parallel_is_one_line_exit_2(moe, flags, words, capsys):
    args = ["estimate", moe, "--seq-len", "32", "--gpus", "4", "--batch-size", "4", "--parallel", "fsdp", *flags]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err


def test_a_dense_model_has_no_experts_to_split(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                                "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "vocab_size": 256}))
    with pytest.raises(MemfitError, match="needs a mixture-of-experts model") as err:
        _estimate(str(path), {"parallel": "fsdp", "ep": 2}, 2)
    assert "\n" not in str(err.value)


def test_memfit_train_with_expert_parallel_equals_one_process(moe, tmp_path, train_in_process):
    """Two torchrun ranks training the MoE with ep=2 take the same losses as one process on the same global batches:
    the experts split and the all-to-all change where the work runs, not the math (the experts' gradient divided by
    the data-parallel degree, as transformers does); the EP run checkpoints and a second EP run resumes it on its
    2 ranks and takes the uninterrupted run's losses. ``memfit train`` runs in this process (``train_in_process``,
    tests/conftest.py): with ``--nproc-per-node 2`` only the ranks start Python and what they print is this
    process's stdout, which is rank 0's summary alone.

    Two launches, not three (issue: the suite's expensive work once): the reference was FSDP2 alone on 2 ranks, now one
    process (in this process, no launch): the math itself rather than a second distributed run of it. The schedule is
    constant, so the run of 2 steps and its resumed steps 3-4 are the uninterrupted 4 steps (before: a 3-step EP run
    was compared and its resume only checked ``resumed_from``; now every resumed loss is compared). The EP run's
    first launch also makes ``memfit train --nproc-per-node 2``'s launch checks of
    tests/test_train_ranks.py (``test_cli_launches_torchrun_and_rank_zero_reports``, on its own launch there): rank 0
    alone prints, the summary's ``processes`` and ``steps``, every metrics line with both ranks, the final
    checkpoint's ``model.safetensors``."""
    def train(out, *extra):
        code, printed = train_in_process([moe, "--seq-len", "32", "--global-batch-size", "4", "--out-dir", out,
                                          "--schedule", "constant", "--json", *extra])
        assert code == 0, printed.err[-3000:]
        return json.loads(printed.out), {row["step"]: row for row in map(json.loads, open(out / "metrics.jsonl"))}

    ranks = ["--nproc-per-node", "2", "--parallel", "fsdp", "--ep", "2"]
    _, one = train(tmp_path / "one", "--steps", "4")
    summary, first = train(tmp_path / "ep", "--steps", "2", *ranks)  # json.loads of all stdout: rank 0 alone prints
    assert summary["recipe"]["ep"] == 2 and summary["processes"] == 2 and summary["steps"] == 2
    assert sorted(first) == [1, 2] and all(len(row["ranks"]) == 2 for row in first.values())
    assert (tmp_path / "ep" / "step-000000002" / "model.safetensors").is_file()
    # its sharded checkpoint (the experts 2-D DTensors over efsdp x ep) loads into the same layout: 2 more steps
    resumed, after = train(tmp_path / "ep", "--steps", "4", *ranks)
    assert resumed["resumed_from"] == 2 and resumed["steps"] == 4
    assert [after[s]["loss"] for s in (1, 2, 3, 4)] == pytest.approx([one[s]["loss"] for s in (1, 2, 3, 4)], abs=1e-5)
