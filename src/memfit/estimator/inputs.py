"""``Hardware`` and ``Data``: where a step runs and what it runs on, as two small frozen values.

``estimate``, ``plan`` and ``fit`` take them (``hardware=``, ``data=``) instead of a pile of keywords,
and the CLI builds them from its flags. Each checks its own fields when it is made, so a negative batch
size or a budget of "24 gigs" is one line naming the fix at the caller's line, not deep in a trace;
sizes are read from text ("24GiB", "80G") once, here.

The keywords they gather (``gpu=``, ``budget=``, ``batch_size=``, ``seq_len=``...) still work:
``gather`` makes the values from them. Giving a value both ways is an error when the two differ.

Left out: the model, the recipe and the step's own switches (``steps``, ``fast``, ``progress``) stay
keywords; the cross-checks that need the recipe or the model (a budget on a CPU estimate, a batch size
the ranks do not divide) are made by the verbs, which know them.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memfit.errors import MemfitError, shown

if TYPE_CHECKING:
    from memfit.hardware.gpus import GPU

__all__ = ["Hardware", "Data", "gather"]


@dataclass(frozen=True)
class Hardware:
    """Where a step runs: whose memory semantics, which card, how much of it, how many of them.

    ``Hardware(gpu="rtx-4090", budget="20GiB")``, ``Hardware(device="cpu")``,
    ``Hardware(gpu="h100-sxm", gpus=8, nodes=2)``. Every field is optional; the verb fills the defaults.
    """

    # a catalog card (a name such as "rtx-4090", stored as its ``memfit.hardware.gpus.GPU``) for CUDA semantics;
    # None: the card torch sees, else h100-sxm
    gpu: GPU | str | None = None
    # "cuda" or "cpu" semantics; None: CUDA, unless MEMFIT_DEVICE=cpu (or the verb's own default)
    device: str | None = None
    # bytes the process may use, context included (read from "24GiB", "24GB", "80G"); None: the whole card
    budget: int | None = None
    # GPUs per node of a data-parallel run (or the cards a device_map spreads over) and the nodes
    gpus: int | None = None
    nodes: int | None = None

    def __post_init__(self):
        from memfit.hardware.gpus import GPU, gpu as lookup, shown_device
        from memfit.units import parse_size

        if self.device is not None:
            if str(self.device).split(":")[0] not in ("cpu", "cuda", "mps"):
                raise MemfitError(f"device {shown_device(self.device)} is not modelled: use device='cpu', 'cuda' "
                                  "or 'mps'")
            if str(self.device).startswith("mps"):  # this Mac, as MPS sees it: a card like any other (macs.py)
                from memfit.hardware.gpus import this_mac

                if self.gpu is None:
                    object.__setattr__(self, "gpu", this_mac())
                object.__setattr__(self, "device", "cuda")
            object.__setattr__(self, "device", str(self.device))
        if self.gpu is not None:
            if not isinstance(self.gpu, (str, GPU)):
                raise MemfitError(f"gpu must be a catalog name like 'rtx-4090' (memfit gpus lists them), got "
                                  f"{type(self.gpu).__name__} {shown(self.gpu, 40)}")
            if self.on_cpu:
                raise MemfitError("gpu and device='cpu' conflict: drop one")
            object.__setattr__(self, "gpu", self.gpu if isinstance(self.gpu, GPU) else lookup(self.gpu))
        if self.budget is not None:
            object.__setattr__(self, "budget", parse_size(self.budget))
        if self.gpus is not None or self.nodes is not None:
            from memfit.hardware.cluster import world_of

            world_of(self.gpus, self.nodes)  # counts from 1 to MAX_GPUS; nodes needs gpus

    def __repr__(self) -> str:  # the card by name: a GPU's repr is its whole catalog entry
        fields = {name: getattr(self, name) for name in _FIELDS[Hardware]}
        shown_fields = ", ".join(f"{name}={_brief(value)}" for name, value in fields.items() if value is not None)
        return f"Hardware({shown_fields})"

    @property
    def on_cpu(self) -> bool:
        """CPU semantics asked for (``device="cpu"``); False when the device is left to the default."""
        return self.device is not None and self.device.startswith("cpu")


@dataclass(frozen=True)
class Data:
    """What a step runs on: how many examples, how long, and (for variable-length text) their lengths.

    ``Data(batch_size=8, seq_len=2048)``, ``Data(lengths="lengths.npy", packed=True, seq_len=4096)``.
    """

    # examples per optimizer step, over all ranks (``plan``'s global batch); None: 1, or the recipe's micro-batches
    batch_size: int | None = None
    # tokens per example of a catalog or config model; None: the model's default
    seq_len: int | None = None
    # per-example token counts: a list or a .txt / .npy / .jsonl path (``models/lengths.py``)
    lengths: object = None
    # documents concatenated into rows of seq_len tokens, attention per document
    packed: bool = False

    def __post_init__(self):
        from memfit.estimator.checks import MAX_SEQ, check_count
        from memfit.techniques.accumulation import MAX_BATCH

        for name, limit in (("batch_size", MAX_BATCH), ("seq_len", MAX_SEQ)):
            if getattr(self, name) is not None:
                check_count(name, getattr(self, name), limit)
        if not isinstance(self.packed, bool):
            raise MemfitError(f"packed must be True or False, got {type(self.packed).__name__} "
                              f"{shown(self.packed, 40)}")
        if isinstance(self.lengths, list):
            object.__setattr__(self, "lengths", tuple(self.lengths))  # frozen all the way down
        elif self.lengths is not None and not _lengths_like(self.lengths):
            raise MemfitError(f"lengths must be a list of token counts or a .txt / .npy / .jsonl path, got "
                              f"{type(self.lengths).__name__} {shown(self.lengths, 40)}")


def _lengths_like(value) -> bool:
    """A path, a sequence or array of counts, or ``estimate_micro_batch``'s one shape."""
    if isinstance(value, (str, os.PathLike, tuple, range)) or hasattr(value, "tolist"):
        return True
    from memfit.models.lengths import MicroBatch

    return isinstance(value, MicroBatch)


_FIELDS = {Hardware: ("gpu", "device", "budget", "gpus", "nodes"), Data: ("batch_size", "seq_len", "lengths", "packed")}


def gather(hardware: Hardware | None = None, data: Data | None = None, *, names: dict | None = None,
           **given) -> tuple[Hardware, Data]:
    """The ``Hardware`` and ``Data`` of a call that may also give their fields as keywords (``gpu=``,
    ``batch_size=``...): made from the keywords when the value is not given; with both, a keyword other
    than its default (None, or False for ``packed``) that differs from the value's field is one error.
    ``names``: the caller's keyword for a field, where it differs (``plan``'s ``global_batch_size``)."""
    names = names or {}
    unknown = set(given) - set(_FIELDS[Hardware]) - set(_FIELDS[Data])
    assert not unknown, unknown  # a caller's mistake, not the user's
    return (_one(Hardware, hardware, "hardware", given, names), _one(Data, data, "data", given, names))


def _one(kind, value, label: str, given: dict, names: dict):
    fields = {name: given[name] for name in _FIELDS[kind] if _given(given.get(name))}
    if value is None:
        try:
            return kind(**fields)
        except MemfitError as err:
            raise MemfitError(_renamed(str(err), names)) from None
    if not isinstance(value, kind):
        raise MemfitError(f"{label} must be a memfit.{kind.__name__}, got {type(value).__name__} {shown(value, 40)}: "
                          f"write {label}=memfit.{kind.__name__}(...)")
    for name, old in fields.items():
        mine = getattr(value, name)
        if not _same(mine, getattr(dataclasses.replace(kind(), **{name: old}), name)):  # "24GiB" is 25769803776
            keyword = names.get(name, name)
            raise MemfitError(f"{keyword}={_brief(old)} and {label}.{name}={_brief(mine)} conflict: give "
                              f"{keyword} once, in {label}= or as a keyword")
    return value


def _given(value) -> bool:
    """A keyword other than its default, None (or False for ``packed``): by identity, since 0 is a given (wrong)
    value and an array of lengths has no truth value."""
    return value is not None and value is not False


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except (TypeError, ValueError):  # arrays of lengths compare element by element
        return a is b


def _brief(value) -> str:
    from memfit.hardware.gpus import GPU

    return repr(value.name) if isinstance(value, GPU) else shown(value, 40)


def _renamed(message: str, names: dict) -> str:
    """An error about a field, in the words of the caller's keyword (``global_batch_size must be ...``)."""
    for name, keyword in names.items():
        if message.startswith(name + " "):
            return keyword + message[len(name):]
    return message
