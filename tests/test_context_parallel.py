"""Context parallelism (issue 35, item 3): ``Recipe(cp=N)`` splits each row's sequence over N ranks of the FSDP2 group
with torch's ``context_parallel`` (load-balanced chunks, ring attention), per rank under the fake process group,
against real ``torchrun`` runs over gloo graded by each rank's allocator events (``memfit.distributed.truth``)."""

from __future__ import annotations

import pytest

import _truths
import memfit
from memfit.cli import main
from memfit.techniques.recipe import Recipe

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
         "max_position_embeddings": 256}


@pytest.fixture(scope="module")
def llama(write_config):
    return write_config(LLAMA)


def _estimate(path, recipe, gpus, batch=2, seq=32, **kwargs):
    return memfit.estimate(path, batch_size=batch, seq_len=seq, recipe=Recipe(**recipe), gpus=gpus, device="cpu",
                           **kwargs)


# (cp_rotate=alltoall, cp=4, HSDP, accumulation: bench/distributed/distributed.py, to keep the suite's time); run on
# 2 ranks with the other modules' truths in one torchrun (tests/_truths.py)
CP2 = {"parallel": "fsdp", "cp": 2}
_truths.register("context_parallel", [(LLAMA, {"recipe": CP2, "batch_size": 2, "seq_len": 32, "steps": 2})])


def test_context_parallel_matches_torchrun_on_every_rank(llama, tmp_path_factory):
    recipe = CP2
    truths, = _truths.results(tmp_path_factory, "context_parallel")
    report = _estimate(llama, recipe, 2, steps=2)
    # the two ranks differ (the ring's causal chunks: rank 0 runs half its queries, rank 1 half the keys); both traced
    estimated = {r["rank"]: r for r in report.ranks}
    assert sorted(estimated) == [0, 1]
    for truth in truths:
        mine = estimated[truth["rank"]]
        assert abs(mine["peak_bytes"] - truth["peak_bytes"]) <= 1024, truth["rank"]
        assert abs(mine["phase_peaks"]["forward"] - truth["phase_peaks"]["forward:1"]) <= 64
    assert report.world["cp"] == 2 and "cp=2 (sequence)" in report.world["mesh"]
    assert any("not yet against a GPU" in n for n in report.notes)


def test_the_sequence_is_what_shrinks(llama):
    """FSDP2 over 2 ranks holds a whole row each; with cp=2 the same 2 ranks hold half of each of 2 rows' tokens
    (the same activations a rank) and every rank reads both rows: a 4-row batch at cp=2 is 2 rows at FSDP2 alone."""
    alone = _estimate(llama, {"parallel": "fsdp"}, 2, batch=2, seq=32)
    split = _estimate(llama, {"parallel": "fsdp", "cp": 2}, 2, batch=1, seq=64)
    # half the tokens a rank of a row twice as long: within the ring's buffers of the same activations (3.5 %)
    assert abs(split.peak_bytes - alone.peak_bytes) / alone.peak_bytes < 0.05
    longer = _estimate(llama, {"parallel": "fsdp", "cp": 2}, 2, batch=1, seq=128)
    assert longer.peak_bytes > split.peak_bytes


@pytest.fixture(scope="module")
def one_block(write_config):
    return write_config(dict(LLAMA, num_hidden_layers=1))


@pytest.mark.parametrize("checkpointing", ["off", "blocks"])
def test_the_ring_runs_under_cuda_semantics(one_block, checkpointing):
    """On a GPU target memfit's SDPA stands in for torch's; torch's context parallel patches that function by its
    name, and under another name its ring missed every call (refused: "never reached torch's ring"; with
    checkpointing the recompute reached it, the forward did not). One block holds every call that could miss."""
    recipe = {"parallel": "fsdp", "mixed_precision": "bf16:fp32", "checkpointing": checkpointing}
    split = memfit.estimate(one_block, batch_size=1, seq_len=128, recipe=Recipe(**recipe, cp=2), gpus=2,
                            gpu="h100-sxm")
    assert split.world["cp"] == 2 and split.peak_bytes > 0


def test_context_parallel_takes_the_depth_fast_path(write_config):
    path = write_config(dict(LLAMA, num_hidden_layers=5))  # 4 blocks traced (0, 1, 2, 4), block 3 written out
    recipe = {"parallel": "fsdp", "cp": 2, "precision": "bf16-mixed", "checkpointing": "blocks"}
    full, fast = (_estimate(path, recipe, 4, batch=2, seq=32, fast=f) for f in (False, True))
    assert [r["peak_bytes"] for r in fast.ranks] == [r["peak_bytes"] for r in full.ranks]
    assert fast.phase_peaks == full.phase_peaks
    assert any("traced 4 of 5 blocks" in n for n in fast.notes)


@pytest.mark.parametrize("flags, words", [
    (["--cp", "3"], "cp=3 does not divide the 4 rank(s)"),
    (["--cp", "2", "--parallel", "ddp"], "needs parallel=fsdp"),
    (["--cp", "2", "--tp", "2"], "conflict"),
    (["--cp", "2", "--attention", "eager"], "conflict"),
    (["--cp", "4", "--seq-len", "36"], "not a multiple of 8"),
    (["--cp-rotate", "alltoall"], "needs context parallelism"),
])
def test_bad_context_parallel_is_one_line_exit_2(llama, flags, words, capsys):
    args = ["estimate", llama, "--seq-len", "32", "--gpus", "4", "--batch-size", "4", "--parallel", "fsdp",
            "--device", "cpu", *flags]
    if "--seq-len" in flags:
        args = args[:2] + args[4:]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err


def test_memfit_train_refuses_context_parallel_in_one_line(llama, tmp_path, capsys):
    data = tmp_path / "tokens.bin"
    data.write_bytes(bytes(range(256)) * 8)
    assert main(["train", llama, "--data", str(data), "--seq-len", "32", "--cp", "2", "--parallel", "fsdp",
                 "--out-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "cp=2" in err and "\n" not in err


def test_the_layout_reads_the_same_rows_on_context_parallel_peers():
    from memfit.hardware.cluster import Layout, World

    layout = Layout.of(World(8), cp=2)
    assert layout.rows_split == 4 and layout.describe() == "dp=4 x cp=2 (sequence)"
    assert [layout.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    hsdp = Layout.of(World(4, 2), cp=2)
    assert hsdp.rows_split == 4 and [hsdp.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert hsdp.describe() == "dp=2x2 (replicate x shard) x cp=2 (sequence)"


def test_a_model_whose_attention_misses_the_ring_is_refused(write_config):
    """BERT's bidirectional attention (a mask-free, non-causal SDPA) never reaches torch's load-balanced ring: the
    sequence would be split with nothing joining it again, so the estimate stops in one line."""
    from memfit.errors import MemfitError

    bert = write_config({"architectures": ["BertForMaskedLM"], "model_type": "bert", "hidden_size": 64,
                         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                         "vocab_size": 1000, "max_position_embeddings": 128})
    with pytest.raises(MemfitError, match="use cp=1") as err:
        _estimate(bert, {"parallel": "fsdp", "cp": 2}, 2)
    assert "\n" not in str(err.value)
