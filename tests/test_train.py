"""train(): OOMs injected in forward, backward and inside the optimizer step are survived with the
same examples in every step and the weights of a fault-free run (within summation order); a run
stopped and resumed equals an uninterrupted one bit for bit; a virtual budget too small for the
planned micro-batch is survived by smaller micro-batches."""

import json
import sys
from pathlib import Path

import pytest
import torch

from memfit import MemfitError, Recipe
from memfit.training.loop import train

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ranks_worker as worker  # noqa: E402


def _tokens():
    return worker.Tokens(48)  # 48 long-tailed examples of 1..64 tokens


def _model():
    return worker.model()  # a 2-block Llama of width 32


def _run(tmp, **kw):
    model = _model()
    args = dict(global_batch_size=8, steps=6, lr=1e-3, out_dir=tmp, progress=False, seed=1,
                recipe=Recipe(micro_batch_size=4, grad_accum_steps=2), seq_len=64)
    args.update(kw)
    result = train(model, _tokens(), **args)
    lines = [json.loads(x) for x in open(tmp / "metrics.jsonl")]
    return model, result, lines


def test_faults_in_every_phase_lose_nothing(tmp_path):
    ref, ref_result, ref_lines = _run(tmp_path / "ref")
    assert len(ref_result.losses) == 6 and not ref_result.ooms
    faults = [(1, 0, "forward"), (2, 1, "backward", 3), (3, 0, "optimizer", 5), (4, 0, "optimizer", 1)]
    model, result, lines = _run(tmp_path / "faults", inject=faults)
    assert [e["phase"] for e in result.ooms] == ["forward", "backward", "optimizer", "optimizer"]
    assert [x["examples"] for x in lines] == [x["examples"] for x in ref_lines]  # none lost or repeated
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)  # micro-batches differ after an OOM: rounding


def test_resume_equals_an_uninterrupted_run_bit_for_bit(tmp_path):
    # warmup then constant: a run told to stop at step 4 has the same schedule up to there
    kw = dict(checkpoint_every=2, schedule="constant", warmup=3)
    whole, _, _ = _run(tmp_path / "whole", **kw)
    _run(tmp_path / "split", steps=4, **kw)  # stops after step 4, as if killed there
    resumed, result, lines = _run(tmp_path / "split", **kw)
    assert result.resumed_from == 4 and result.steps == 6 and len(result.losses) == 2
    for a, b in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_a_tight_virtual_budget_is_survived_with_smaller_micro_batches(tmp_path):
    # a token cap of 16 full rows (not the estimate): activations dominate, so a smaller cap is survivable
    kw = dict(steps=2, global_batch_size=16, recipe=Recipe(), micro_tokens=16 * 64)
    _, free, _ = _run(tmp_path / "free", budget="1GiB", **kw)  # a budget never reached: counts the peak
    limit = int(free.peak_bytes * 0.8)
    _, tight, lines = _run(tmp_path / "tight", budget=limit, **kw)
    assert tight.ooms and tight.peak_bytes <= limit
    assert all(x["memory_peak"] <= limit for x in lines)
    assert lines[-1]["micro_token_cap"] < lines[0]["ooms"][0]["cap"]


def test_micro_batches_sized_by_the_estimate_fit_without_an_oom(tmp_path):
    kw = dict(steps=3, global_batch_size=16, recipe=Recipe())
    _, free, free_lines = _run(tmp_path / "free", budget="1GiB", **kw)
    assert all(x["micro_batches"] == 1 for x in free_lines)  # everything fits one micro-batch
    limit = int(free.peak_bytes * 0.8)
    _, tight, lines = _run(tmp_path / "tight", budget=limit, **kw)
    assert not tight.ooms and tight.peak_bytes <= limit  # the estimate sized them: no OOM to recover from
    assert max(x["micro_batches"] for x in lines) > 1
    for x in lines:  # the estimate of the largest shape the step formed bounds what the allocator held
        assert x["memory_peak"] <= x["predicted"] <= limit, x
    assert lines[0]["estimate_seconds"] > 0 and lines[-1]["estimate_seconds"] == 0  # estimated once, then cached
    assert [x["examples"] for x in lines] == [x["examples"] for x in free_lines]


def test_dataloader_workers_give_the_same_run(tmp_path):
    _, plain, _ = _run(tmp_path / "plain", steps=2)
    _, workers, _ = _run(tmp_path / "workers", steps=2, workers=2)
    assert plain.losses == workers.losses
    with pytest.raises(MemfitError, match="workers must be"):
        _run(tmp_path / "bad", steps=1, workers=-1)


def test_bad_arguments_are_one_line(tmp_path):
    with pytest.raises(MemfitError, match="one of global_batch_size"):
        train(_model(), _tokens(), steps=1, out_dir=tmp_path)
    with pytest.raises(MemfitError, match="one of steps or epochs"):
        train(_model(), _tokens(), global_batch_size=2, out_dir=tmp_path)


def test_tensorboard_gets_the_metrics(tmp_path):
    pytest.importorskip("tensorboard")  # in the dev extra; the run writes metrics.jsonl without it
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, result, lines = _run(tmp_path / "tb", steps=3, tensorboard=True)
    board = EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    board.Reload()
    logged = [event.value for event in board.Scalars("train/loss")]
    assert [event.step for event in board.Scalars("train/loss")] == [1, 2, 3]
    assert logged == pytest.approx(result.losses, rel=1e-6) and len(board.Scalars("train/lr")) == 3


def test_packed_rows_train_as_the_padded_documents(tmp_path):
    # per-document attention and labels: packing changes the layout, not the update
    padded, _, padded_lines = _run(tmp_path / "padded", steps=3, recipe=Recipe())
    packed, result, lines = _run(tmp_path / "packed", steps=3, recipe=Recipe(), packed=True)
    assert [x["examples"] for x in lines] == [x["examples"] for x in padded_lines]
    assert max(x["micro_batches"] for x in lines) == 1 and not result.ooms
    for a, b in zip(padded.parameters(), packed.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    with pytest.raises(MemfitError, match="packs documents"):
        _run(tmp_path / "bad", steps=1, packed=True, batching="rows")


def test_packed_rows_sized_by_the_estimate(tmp_path):
    kw = dict(steps=2, global_batch_size=16, recipe=Recipe(), packed=True)
    _, free, _ = _run(tmp_path / "free", budget="1GiB", **kw)
    limit = int(free.peak_bytes * 0.8)
    _, tight, lines = _run(tmp_path / "tight", budget=limit, **kw)
    assert not tight.ooms and max(x["micro_batches"] for x in lines) > 1
    assert all(x["memory_peak"] <= x["predicted"] <= limit for x in lines)
