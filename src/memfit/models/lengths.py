"""Variable-length data: per-example token counts, the micro-batches they make, and their batches.

Two ways published runs batch documents of different lengths:

* **padded** (``packed=False``): consecutive examples, ``rows`` at a time (a ``DataLoader`` without
  shuffling), each micro-batch padded to its longest row and given an ``attention_mask``
  (``DataCollatorWithPadding``); an example longer than ``seq_len`` is truncated to it (a tokenizer's
  ``max_length``).
* **packed** (``packed=True``): documents concatenated in order into rows of ``seq_len`` tokens, a
  document that does not fit starting the next row (torchtune's ``PackedDataset`` with
  ``split_across_pack=False``; a document longer than ``seq_len`` is truncated to it, as TRL's
  ``pack_dataset`` does), the end of a row padded. Attention stays within each document through
  ``position_ids`` that restart at 0 per document, which is how transformers detects packing
  (``masking_utils.find_packed_sequence_indices``) and builds a block-causal mask for sdpa / eager.

What the memory of a micro-batch depends on is its shape (``MicroBatch``): rows, padded length,
packed or not, and whether it is *ragged* — a padded one with at least one padding token, a packed
one with at least one row holding two documents. transformers builds the 4-D mask only then; a
micro-batch that is not ragged runs as a dense one (``is_causal``, no mask). The token values do not
matter, so the batches made here hold zeros as tokens; the positions and masks follow the lengths.

Accepted length files (one example per entry, token counts): ``.txt`` (one integer a line, blank
lines skipped), ``.npy`` (a 1-D integer array) and ``.jsonl`` (one object a line, with an
``input_ids`` list or a ``length`` field).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from memfit.errors import MemfitError, shown

__all__ = ["MicroBatch", "read_lengths", "micro_batches", "worst_shapes", "shape_batch", "direct", "check_task", "unread_masks", "positions",
           "MAX_EXAMPLES", "LENGTH_FILES"]

MAX_EXAMPLES = 1 << 24  # examples read from one list or file
LENGTH_FILES = (".txt", ".npy", ".jsonl")
_MAX_LENGTH = 1 << 24  # tokens in one example (memfit's seq_len bound)


@dataclass(frozen=True)
class MicroBatch:
    """The shape of one micro-batch of variable-length data: what its memory depends on.

    rows      examples (padded) or packed rows in the micro-batch.
    length    tokens per row: the longest row (padded) or the pack size ``seq_len`` (packed).
    packed    rows of concatenated documents with per-document attention.
    ragged    padded: some row is shorter than ``length`` (an attention mask with zeros); packed:
              some row holds two or more documents. Only then does transformers build a 4-D mask.
    index     which micro-batch of the lengths given it is (0-based, in their order); None for a
              shape asked for directly.
    count     how many micro-batches the lengths make.
    tokens    real (not padding) tokens in it.
    docs      per row, the token counts of its examples (padded: one each; packed: its documents).
    """

    rows: int
    length: int
    packed: bool = False
    ragged: bool = True
    index: int | None = None
    count: int | None = None
    tokens: int | None = None
    docs: tuple[tuple[int, ...], ...] | None = None

    def summary(self) -> dict:
        """The fields a Report keeps (``Report.micro_batch``)."""
        return {"rows": self.rows, "length": self.length, "packed": self.packed, "ragged": self.ragged,
                "index": self.index, "count": self.count, "tokens": self.tokens}

    def row_docs(self) -> tuple[tuple[int, ...], ...]:
        """Each row's documents; for a shape asked for directly, rows that make it ragged: a padded
        micro-batch whose last row is one token short, packed rows of two documents each."""
        if self.docs is not None:
            return self.docs
        if not self.ragged or self.length == 1:
            return ((self.length,),) * self.rows
        if self.packed:
            half = self.length // 2
            return ((half, self.length - half),) * self.rows
        return ((self.length,),) * (self.rows - 1) + ((self.length - 1,),)


def read_lengths(lengths) -> tuple[int, ...]:
    """Per-example token counts from a sequence of ints or a path (``.txt``, ``.npy``, ``.jsonl``)."""
    if isinstance(lengths, (str, os.PathLike)):
        values = _read_file(os.fspath(lengths))
    elif isinstance(lengths, torch.Tensor):
        values = lengths.flatten().tolist()
    elif hasattr(lengths, "tolist") and not isinstance(lengths, (list, tuple)):  # a numpy array
        values = lengths.tolist()
    elif isinstance(lengths, (list, tuple, range)):
        values = list(lengths)
    else:
        raise MemfitError(f"lengths must be a list of token counts or a {'/'.join(LENGTH_FILES)} path, "
                          f"got {type(lengths).__name__}")
    if not values:
        raise MemfitError("lengths is empty: give at least one example's token count")
    if len(values) > MAX_EXAMPLES:
        raise MemfitError(f"lengths has {len(values):,} examples, more than {MAX_EXAMPLES:,}: pass a sample of them")
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= _MAX_LENGTH:
            raise MemfitError(f"lengths[{i}] must be a token count from 1 to {_MAX_LENGTH}, got {shown(value)}")
    return tuple(values)


def _read_file(path: str) -> list:
    ext = os.path.splitext(path)[1].lower()
    if ext not in LENGTH_FILES:
        raise MemfitError(f"cannot read lengths from {path}: use a .txt (one integer a line), .npy or .jsonl "
                          "(input_ids or length per line) file")
    if not os.path.isfile(path):
        raise MemfitError(f"no lengths file at {path}: check the path")
    if ext == ".npy":
        import numpy as np

        try:
            array = np.load(path, allow_pickle=False)
        except (ValueError, OSError) as err:
            raise MemfitError(f"{path} is not a .npy array: {str(err).splitlines()[0][:120]}") from None
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise MemfitError(f"{path} holds a {array.ndim}-D {array.dtype} array: save a 1-D integer array")
        return array.tolist()
    values = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            if len(values) >= MAX_EXAMPLES:
                break
            values.append(_parse_line(line, ext, path, number))
    return values


def _parse_line(line: str, ext: str, path: str, number: int):
    where = f"{path} line {number}"
    if ext == ".txt":
        try:
            return int(line.strip())
        except ValueError:
            raise MemfitError(f"{where} is not an integer: write one token count a line") from None
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        raise MemfitError(f"{where} is not JSON: write one object a line") from None
    if isinstance(row, dict) and isinstance(row.get("input_ids"), list):
        return len(row["input_ids"])
    if isinstance(row, dict) and "length" in row:
        return row["length"]
    raise MemfitError(f"{where} has neither an input_ids list nor a length field")


def micro_batches(lengths, rows: int, *, packed: bool, seq_len: int | None) -> list[MicroBatch]:
    """Every micro-batch of ``rows`` rows the lengths make, in order (see the module docstring)."""
    if packed:
        if seq_len is None:
            raise MemfitError("packed=True needs seq_len: the tokens of one packed row")
        groups = _packs(lengths, seq_len)
    else:
        groups = [(min(n, seq_len) if seq_len else n,) for n in lengths]
    count = -(-len(groups) // rows)
    out = []
    for index in range(count):
        docs = tuple(groups[index * rows:(index + 1) * rows])
        longest = seq_len if packed else max(d[0] for d in docs)
        ragged = any(len(d) > 1 for d in docs) if packed else any(d[0] < longest for d in docs)
        out.append(MicroBatch(rows=len(docs), length=longest, packed=packed, ragged=ragged, index=index, count=count,
                              tokens=sum(map(sum, docs)), docs=docs))
    return out


def _packs(lengths, seq_len: int) -> list[tuple[int, ...]]:
    packs, current, used = [], [], 0
    for n in lengths:
        n = min(n, seq_len)
        if used + n > seq_len:
            packs.append(tuple(current))
            current, used = [], 0
        current.append(n)
        used += n
    packs.append(tuple(current))
    return packs


def worst_shapes(batches: list[MicroBatch]) -> list[MicroBatch]:
    """The micro-batches no other one dominates in rows, length and raggedness (the first of each
    shape): the worst micro-batch is one of them, since the peak grows with each."""
    first: dict[tuple, MicroBatch] = {}
    for mb in batches:
        first.setdefault((mb.rows, mb.length, mb.ragged), mb)

    def dominated(a: MicroBatch) -> bool:
        return any(b is not a and b.rows >= a.rows and b.length >= a.length and b.ragged >= a.ragged
                   for b in first.values())
    return [mb for mb in first.values() if not dominated(mb)]


def shape_batch(shape: MicroBatch, repeat: int = 1, *, task: str = "causal-lm") -> dict:
    """The batch of ``shape`` as a Hugging Face model takes it, ``repeat`` copies stacked (one per
    micro-batch of an accumulation step), made on the current device / fake mode.

    Padded and ragged: ``input_ids``, ``labels`` (-100 on padding) and ``attention_mask``. Packed and
    ragged: ``position_ids`` restarting at 0 per document (padding continues the last document) and
    ``use_cache=False``: with transformers 5 a training forward that builds a ``DynamicCache`` (the
    config's default ``use_cache=True``) skips packed-sequence detection, so documents would attend
    to each other. Not ragged: the same tensors, with an all-ones mask or positions that never restart
    (transformers then runs the dense path; on fake tensors: ``unread_masks``, ``estimator/packing.py``).
    """
    rows, length = shape.rows * repeat, shape.length
    ids = torch.zeros(rows, length, dtype=torch.long)  # token values do not change memory
    if shape.packed:
        return {"input_ids": ids, "labels": ids.clone(), "position_ids": positions(shape, repeat), "use_cache": False}
    docs = shape.row_docs() * repeat
    mask = torch.stack([torch.arange(length) < row[0] for row in docs]).long()
    labels = ids.masked_fill(mask == 0, -100) if task == "causal-lm" else ids.clone()
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def unread_masks(model: torch.nn.Module) -> None:
    """Keep ``attention_mask`` from reaching ``model`` (and its base model) for a padded micro-batch
    with no padding, traced on fake tensors. transformers decides whether to build a 4-D mask from the
    mask's values and takes every fake tensor for a traced one that may hold padding (``is_tracing``):
    it would build the mask that the real run, reading an all-ones mask, skips. The tensor stays in
    the batch, so its bytes are counted; the model runs the dense path, as it does for real."""
    def drop(module, args, kwargs):
        return args, {k: v for k, v in kwargs.items() if k != "attention_mask"}

    for sub in {model, getattr(model, "base_model", model)}:
        sub.register_forward_pre_hook(drop, with_kwargs=True)


def positions(shape: MicroBatch, repeat: int = 1) -> torch.Tensor:
    """The position ids of a packed ``shape`` (``repeat`` copies stacked): 0 at each document's start,
    padding continuing the last document."""
    return torch.stack([_positions(row, shape.length) for row in shape.row_docs() * repeat])


def _positions(docs: tuple[int, ...], length: int) -> torch.Tensor:
    parts = [torch.arange(n) for n in docs]
    pad = length - sum(docs)
    if pad:
        parts[-1] = torch.arange(docs[-1] + pad)
    return torch.cat(parts)


def direct(rows: int, length: int, packed: bool, ragged: bool) -> MicroBatch:
    """A shape asked for directly (no lengths), checked."""
    for name, value in (("rows", rows), ("length", length)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= _MAX_LENGTH:
            raise MemfitError(f"{name} must be an integer from 1 to {_MAX_LENGTH}, got {shown(value)}")
    return MicroBatch(rows=rows, length=length, packed=bool(packed), ragged=bool(ragged) and length > 1)


def check_task(task: str | None, packed: bool, name: str) -> None:
    """Variable-length batches are made for Hugging Face causal LMs (padded or packed) and masked LMs
    (padded): the models whose masks come from ``attention_mask`` / ``position_ids``."""
    if packed and task != "causal-lm":
        raise MemfitError(f"packed=True is for causal language models (per-document attention from position_ids); "
                          f"{name} is {task or 'not a Hugging Face config'}: use packed=False, or pass batch=")
    if task not in ("causal-lm", "masked-lm"):
        raise MemfitError(f"lengths= makes batches for Hugging Face causal or masked LMs; {name} is "
                          f"{task or 'not a Hugging Face config'}: pass batch= with your padded batch")
