"""One global batch to an applied update, whatever out-of-memory errors come (``train``'s step).

The batch is cut into micro-batches (by the estimate of each shape, by padded tokens, or by fixed
rows), read, and run forward and backward; an out-of-memory error drops the gradients, halves the
micro-batches and redoes the whole batch, so the update never changes. The optimizer step is
``SafeStep``'s, rolled back chunk by chunk and retried. In a data-parallel run (``ranks``) each rank
takes its share of the batch in as many micro-batches as every other rank, and an error on any rank
is redone by all (``lockstep.py``).
"""

from __future__ import annotations

import gc

import torch

from memfit.errors import MemfitError
from memfit.hardware.mps import oom_as_torch
from memfit.techniques.step import label_counts
from memfit.training.batching import micro_batches
from memfit.training.lockstep import HOPELESS, PeerOutOfMemory, even_micro_batches, split_by_tokens

__all__ = ["one_step", "MAX_STEP_RETRIES"]

MAX_STEP_RETRIES = 3  # an optimizer step rolled back this many times in a row is out of memory for good


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def one_step(step_fn, reader, ids, lengths, micro_tokens, scale, vb, index, device, rows, shapes, pack_to=None,
              ranks=None):
    """One global batch to an applied update, whatever out-of-memory errors come; returns its loss,
    the OOM events survived (the last one's ``scale`` is the new scale), the predicted peak of its
    largest micro-batch (``ShapeBudget.bound``; None without a budget), the seconds spent estimating
    and the number of micro-batches. With ``ranks`` (a data-parallel run), this rank's share of the
    batch, in as many micro-batches as every other rank's, an out-of-memory error anywhere redone by
    all (``lockstep.py``)."""
    events, estimating = [], 0.0
    lock = ranks.lockstep if ranks is not None else None
    while True:
        began = 0.0 if shapes is None else shapes.seconds
        cap = None if rows is not None or shapes is not None else max(1, int(micro_tokens * scale))
        if ranks is None:
            groups = [[[ids[i] for i in row] for row in g] for g in _cut(ids, lengths, rows, scale, shapes, cap, pack_to)]
            dummies = [False] * len(groups)
        else:  # every rank's cut (no collective: the same arithmetic everywhere), then as many as the most
            shares = split_by_tokens(ids, lengths, ranks.world)
            cuts = [[[[share[i] for i in row] for row in g] for g in _cut(share, lengths, rows, scale, shapes, cap,
                                                                      pack_to)] if share else [] for share in shares]
            groups = even_micro_batches(cuts[ranks.rank], max(len(c) for c in cuts))
            dummies = [g is None for g in groups]
            groups = [[[ids[0]]] if g is None else g for g in groups]  # a borrowed row, weighted zero
        # each micro-batch as (example, row) pairs: a padded row holds one example, a packed row several
        members = [[(int(i), r) for r, row in enumerate(g) for i in row] for g in groups]
        predicted = None if shapes is None else max(
            shapes.bound(len(g), pack_to or max(int(lengths[i]) for i, _ in m)) for g, m in zip(groups, members))
        if shapes is not None:  # the seconds its estimates took (looking up a known shape is not one)
            estimating += shapes.seconds - began
        if vb is not None:
            vb.at(index, -1, "read")
        micro = reader.read(members, shapes)
        mine, weights = None, None
        if ranks is not None:  # outside the try: an OOM here cannot be matched by the peers, and is fatal
            counts = label_counts(step_fn.model, micro) or [m["input_ids"].shape[0] for m in micro]
            weights = ranks.weights(counts, dummies)
        try:
            with oom_as_torch():  # MPS's is a RuntimeError
                loss = _backward(step_fn, micro, vb, index, weights, lock.micro if lock is not None else None)
            break
        except torch.OutOfMemoryError as err:
            peer = isinstance(err, PeerOutOfMemory)
            where = vb.where if vb is not None and vb.where else (index, None, "forward or backward")
            step_fn.opt.zero_grad(set_to_none=True)  # the partial gradients go; the batch is redone whole
            del micro
            mine = not peer
            hopeless = all(len(g) == 1 for g in groups)
            if hopeless and ranks is None:
                raise MemfitError("out of memory with one row per micro-batch: raise the budget, shorten the "
                                  "sequences or use a recipe that saves more memory") from None
            scale /= 2
            event = {"step": index + 1, "phase": "another rank's" if peer else where[2],
                     "micro_batch": None if peer else where[1], "micro_batches": len(groups),
                     "rows": max(len(g) for g in groups), "cap": cap, "predicted": predicted, "scale": scale,
                     "error": str(err).splitlines()[0]}
            if ranks is not None:
                event["rank"] = ranks.rank
            events.append(event)
        _free(device)  # out of the except block: the error's frames (and the graph they hold) are gone
        if lock is not None:
            if mine:
                lock.recover(hopeless)  # the rest of the micro-batch's collectives, then the agreement
            else:
                lock.reset()
            if lock.verdict == HOPELESS:
                raise MemfitError("out of memory with one row per micro-batch on some rank: raise the budget, "
                                  "shorten the sequences or use a recipe that saves more memory")
    gave_up = True
    for attempt in range(MAX_STEP_RETRIES + 1):
        if vb is not None:
            vb.at(index, 0, "optimizer")
        try:
            with oom_as_torch():
                step_fn.update()
            gave_up = False
            break
        except torch.OutOfMemoryError as err:
            if step_fn.stepper is None:
                if lock is not None:
                    lock.agree(True, "optimizer")
                raise MemfitError("out of memory inside an optimizer step that cannot be rolled back (fp16 with a "
                                  "GradScaler, an 8-bit optimizer, or chunks=None): raise the budget, or use bf16 "
                                  "and a torch optimizer") from None
            event = {"step": index + 1, "phase": "optimizer", "micro_batch": None, "scale": scale,
                     "rolled_back": True, "error": str(err).splitlines()[0]}
            if ranks is not None:
                event["rank"] = ranks.rank
            events.append(event)
        _free(device)
    if lock is not None and lock.agree(gave_up, "optimizer") and not gave_up:
        raise MemfitError(f"another rank ran out of memory in the optimizer step {MAX_STEP_RETRIES + 1} times: "
                          "raise the budget or use an optimizer with less state")
    if gave_up:
        raise MemfitError(f"out of memory in the optimizer step {MAX_STEP_RETRIES + 1} times, one parameter at a "
                          "time: raise the budget or use an optimizer with less state")
    return loss, events, predicted, estimating, len(groups)


def _cut(ids, lengths, rows, scale, shapes, cap, pack_to):
    """``ids`` cut into micro-batches, each a list of rows, each row the positions (into ``ids``) it holds."""
    if rows is not None:  # fixed rows in data order
        size = max(1, int(rows * scale))
        return [[[k] for k in range(j, min(j + size, len(ids)))] for j in range(0, len(ids), size)]
    if shapes is not None:  # rows by the estimate of each shape
        return micro_batches([int(lengths[i]) for i in ids], lambda n, length: shapes.fits(n, length, scale),
                             seq_len=pack_to)
    return micro_batches([int(lengths[i]) for i in ids], lambda n, length: n == 1 or n * length <= cap,
                         seq_len=pack_to)


def _backward(step_fn, micro, vb, index, weights=None, around=None):
    if vb is None:
        return step_fn.backward(micro, weights=weights, around=around)
    # the step's phases, told to the virtual budget as they begin
    original = step_fn.watch.begin
    counter = {"part": -1}

    def begin(phase, step):
        if phase == "forward":
            counter["part"] += 1
        vb.at(index, counter["part"], phase)
        original(phase, step)

    step_fn.watch.begin = begin
    try:
        return step_fn.backward(micro, weights=weights, around=around)
    finally:
        step_fn.watch.begin = original
