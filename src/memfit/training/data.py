"""Training data: token files, JSONL text, saved Hugging Face datasets; a resumable order.

Three sources, each a ``torch.utils.data.Dataset`` of examples ``{"input_ids": LongTensor}`` with a
``lengths`` array (tokens per example) that the planner and the micro-batcher read:

- a token file in nanoGPT's layout (``train.bin``: a flat array of token ids, ``uint16`` unless
  told), opened as ``np.memmap`` and cut into blocks of ``seq_len`` tokens;
- a JSONL file with a ``text`` field per line, tokenized once with a local tokenizer (a
  directory ``AutoTokenizer.from_pretrained`` reads; no hub access), or an ``input_ids`` field;
- a dataset written by ``datasets.Dataset.save_to_disk`` with an ``input_ids`` column.

``Order`` is the sequence examples are drawn in: a permutation per epoch from a seed, and a
position ``(epoch, index)`` that a checkpoint saves, so a resumed run draws the same examples in
the same order with nothing lost or repeated. ``collate`` pads a list of examples to the longest
(labels ``-100`` on padding, so padding adds no loss).

Why by hand: ``DataLoader``'s samplers keep no position to resume from; the rest is numpy and torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from memfit.errors import MemfitError

__all__ = ["TokenBlocks", "JsonlTexts", "SavedDataset", "open_data", "Order", "collate", "pack_rows", "IGNORE"]

IGNORE = -100  # the label Hugging Face's losses skip


class TokenBlocks(torch.utils.data.Dataset):
    """nanoGPT's ``.bin`` token file in blocks of ``seq_len`` tokens (the tail that is shorter is left out)."""

    def __init__(self, path, seq_len: int, dtype: str = "uint16"):
        path = Path(path)
        if not path.is_file():
            raise MemfitError(f"no token file {path}: write one with numpy (tokens.astype(np.uint16).tofile(path))")
        self.tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
        if seq_len < 1 or len(self.tokens) < seq_len:
            raise MemfitError(f"{path} holds {len(self.tokens)} tokens, fewer than one block of seq_len={seq_len}: "
                              "use a smaller --seq-len")
        self.seq_len = seq_len
        self.lengths = np.full(len(self.tokens) // seq_len, seq_len, dtype=np.int64)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        start = int(i) * self.seq_len
        return {"input_ids": torch.from_numpy(self.tokens[start:start + self.seq_len].astype(np.int64))}


class JsonlTexts(torch.utils.data.Dataset):
    """One example per line: ``{"text": ...}`` tokenized with ``tokenizer``, or ``{"input_ids": [...]}``;
    each cut to ``max_len`` tokens."""

    def __init__(self, path, *, tokenizer=None, max_len: int | None = None):
        path = Path(path)
        if not path.is_file():
            raise MemfitError(f"no JSONL file {path}")
        rows = []
        with open(path, encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise MemfitError(f"{path}:{number}: not JSON ({err.msg}): one object per line") from None
        if not rows:
            raise MemfitError(f"{path} has no examples")
        if all("input_ids" in r for r in rows):
            ids = [list(r["input_ids"]) for r in rows]
        elif all("text" in r for r in rows):
            tok = _tokenizer(tokenizer, path)
            ids = tok([r["text"] for r in rows], add_special_tokens=True)["input_ids"]
        else:
            raise MemfitError(f"{path}: every line needs a 'text' or an 'input_ids' field")
        self.ids = [np.asarray(x[:max_len] if max_len else x, dtype=np.int64) for x in ids]
        if any(len(x) == 0 for x in self.ids):
            raise MemfitError(f"{path} has an empty example: drop empty lines of text")
        self.lengths = np.array([len(x) for x in self.ids], dtype=np.int64)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": torch.from_numpy(self.ids[int(i)])}


def _tokenizer(tokenizer, path):
    if tokenizer is None:
        raise MemfitError(f"{path} holds text: pass a tokenizer (a local directory or a tokenizer object)")
    if isinstance(tokenizer, (str, Path)):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
        except (OSError, ValueError) as err:
            raise MemfitError(f"cannot load a tokenizer from {tokenizer} ({str(err).splitlines()[0]}): "
                              "pass a local directory with tokenizer files") from None
    return tokenizer


class SavedDataset(torch.utils.data.Dataset):
    """A ``datasets.Dataset.save_to_disk`` directory with an ``input_ids`` column."""

    def __init__(self, path, max_len: int | None = None):
        try:
            import datasets
        except ImportError:
            raise MemfitError("reading a saved dataset needs the datasets package: pip install datasets") from None
        data = datasets.load_from_disk(str(path))
        if isinstance(data, datasets.DatasetDict):
            if "train" not in data:
                raise MemfitError(f"{path} has splits {', '.join(data)}: point at one split's directory")
            data = data["train"]
        if "input_ids" not in data.column_names:
            raise MemfitError(f"{path} has no input_ids column (columns: {', '.join(data.column_names)}): tokenize it first")
        self.data, self.max_len = data.with_format("numpy", columns=["input_ids"]), max_len
        self.lengths = np.array([min(len(x), max_len or len(x)) for x in self.data["input_ids"]], dtype=np.int64)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        ids = np.asarray(self.data[int(i)]["input_ids"], dtype=np.int64)
        return {"input_ids": torch.from_numpy(ids[:self.max_len] if self.max_len else ids)}


def open_data(path, *, seq_len: int, tokenizer=None, dtype: str = "uint16"):
    """The dataset at ``path`` by its form: ``.bin`` token file, ``.jsonl``, or a saved dataset directory."""
    path = Path(path)
    if path.is_dir():
        return SavedDataset(path, max_len=seq_len)
    if path.suffix == ".bin":
        return TokenBlocks(path, seq_len, dtype)
    if path.suffix in (".jsonl", ".json"):
        return JsonlTexts(path, tokenizer=tokenizer, max_len=seq_len)
    raise MemfitError(f"unknown data {path}: a nanoGPT .bin token file, a .jsonl file or a saved dataset directory")


class Order:
    """Which example comes next: a seeded permutation per epoch and a resumable position."""

    def __init__(self, size: int, seed: int = 0, shuffle: bool = True):
        if size < 1:
            raise MemfitError("the dataset is empty")
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch, self.index = 0, 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.size)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.size, generator=g).numpy()

    def take(self, n: int) -> list[int]:
        """The next ``n`` example ids (crossing into the next epoch when this one ends)."""
        out = []
        while len(out) < n:
            if self.index == self.size:
                self.epoch, self.index = self.epoch + 1, 0
                self._perm = self._permutation(self.epoch)
            k = min(n - len(out), self.size - self.index)
            out.extend(int(i) for i in self._perm[self.index:self.index + k])
            self.index += k
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "size": self.size}

    def load_state_dict(self, state: dict) -> None:
        if state["size"] != self.size or state["seed"] != self.seed:
            raise MemfitError(f"the checkpoint was written for {state['size']} examples with seed {state['seed']}, "
                              f"this run has {self.size} with seed {self.seed}: resume with the same data and seed")
        self.epoch, self.index = state["epoch"], state["index"]
        self._perm = self._permutation(self.epoch)


def collate(examples: list[dict], pad_id: int = 0, length: int | None = None) -> dict:
    """Pad ``examples`` to the longest (or ``length``): ``input_ids``, ``attention_mask`` and ``labels``
    (``IGNORE`` on padding). Rows with no padding carry no ``attention_mask``: one of all ones is no mask
    to a causal model, and transformers drops it only after checking every value on the device (a sync
    per step), while an estimate on fake tensors cannot check and keeps it (a materialised mask and the
    masked attention kernel; the planner's batches have none: Llama-3.2-1B at 2 x 2048, 24.66 GiB
    reserved with the mask against 24.59 without)."""
    longest = max(len(e["input_ids"]) for e in examples) if length is None else length
    ids = torch.full((len(examples), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), longest), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[row, :n] = e["input_ids"]
        mask[row, :n] = 1
    labels = ids.masked_fill(mask == 0, IGNORE)
    if all(len(e["input_ids"]) == longest for e in examples):
        return {"input_ids": ids, "labels": labels}
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def pack_rows(rows: list[list[dict]], length: int, pad_id: int = 0) -> dict:
    """Rows of documents packed into ``length`` tokens each: ``input_ids``, ``labels`` (``IGNORE`` on
    each document's first token, so no document predicts the next one's start, and on padding),
    ``position_ids`` restarting at 0 per document (padding continues the last one: transformers then
    keeps attention within each document) and ``use_cache=False`` (a cache would skip that check)."""
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE, dtype=torch.long)
    positions = torch.zeros((len(rows), length), dtype=torch.long)
    for r, docs in enumerate(rows):
        at = 0
        for doc in docs:
            tokens = torch.as_tensor(doc["input_ids"])
            n = len(tokens)
            if at + n > length:
                raise MemfitError(f"documents of {at + n} tokens do not fit a packed row of {length}")
            ids[r, at:at + n] = tokens
            labels[r, at + 1:at + n] = tokens[1:]
            positions[r, at:at + n] = torch.arange(n)
            at += n
        if at < length:  # padding continues the last document's positions
            start = int(positions[r, at - 1]) + 1 if at else 0
            positions[r, at:] = torch.arange(start, start + length - at)
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "use_cache": False}
