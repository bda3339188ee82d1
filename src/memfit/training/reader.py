"""Micro-batches read through a ``DataLoader``: each optimizer step's micro-batches are the batch
sampler's batches, collated padded (to the length bucket ``ShapeBudget`` estimated) or packed.

The sampler is set before each pass, so ``workers`` processes are started once and kept between
steps (``persistent_workers``); on CUDA batches are pinned and copied with ``non_blocking``. Why by
hand: torch's samplers fix their batches up front; ``train`` forms each step's micro-batches from
the step's examples and the memory budget, and redoes them smaller after an out-of-memory error.
"""

from __future__ import annotations

import functools

import torch

from memfit.training.data import collate, pack_rows
from memfit.training.predict import bucket_length

__all__ = ["Reader"]


class _Groups:
    """A DataLoader batch sampler whose batches are set before each pass: one global batch's micro-batches."""

    def __init__(self):
        self.batches: list[list[int]] = []

    def __iter__(self):
        return iter(list(self.batches))

    def __len__(self):
        return len(self.batches)


class _Rows(torch.utils.data.Dataset):
    """``data`` read by (example, row) pairs: each example comes back with the row it goes in."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, key):
        index, row = key
        return row, self.data[index]


def _collate(pairs, pad_id, step, longest, pack_to):
    rows: dict[int, list] = {}
    for row, example in pairs:
        rows.setdefault(row, []).append(example)
    if pack_to is not None:
        return pack_rows(list(rows.values()), pack_to, pad_id)
    examples = [docs[0] for docs in rows.values()]
    length = None
    if step is not None:  # padded to the length's bucket: the shape ShapeBudget estimated
        length = bucket_length(max(len(e["input_ids"]) for e in examples), step, longest)
    return collate(examples, pad_id, length)


class Reader:
    """Micro-batches read through a ``DataLoader``: ``workers`` processes (kept between steps), on
    CUDA pinned memory and ``non_blocking`` copies."""

    def __init__(self, data, pad_id: int, workers: int, device: torch.device, pack_to: int | None = None):
        self.data, self.pad_id, self.workers, self.device, self.pack_to = _Rows(data), pad_id, workers, device, pack_to
        self.sampler = _Groups()
        self.loader, self.step = None, None

    def read(self, members: list[list[tuple[int, int]]], shapes) -> list[dict]:
        step = None if shapes is None else (shapes.step, shapes.longest)
        if self.loader is None or step != self.step:
            self.close()
            self.step = step
            self.loader = torch.utils.data.DataLoader(
                self.data, batch_sampler=self.sampler, num_workers=self.workers,
                collate_fn=functools.partial(_collate, pad_id=self.pad_id, step=step and step[0],
                                             longest=step and step[1], pack_to=self.pack_to),
                pin_memory=self.device.type == "cuda", persistent_workers=self.workers > 0)
        self.sampler.batches = members
        if self.device.type != "cuda":
            return list(self.loader)
        return [{k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                 for k, v in batch.items()} for batch in self.loader]

    def close(self) -> None:
        iterator = getattr(self.loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        self.loader = None
