"""The vocabulary of a ledger's log: its records (one per storage), probe sites, event kinds, and
the readings of the log every replay shares (``storage_events``, ``managed_peak``, ``plain``).

Apart from ``ledger.py`` so the recorder and the readers of what it recorded (``replay.py``,
``synth.py``, the allocator replay in ``estimator/verdict.py``) share one small module; ``ledger.py``
re-exports every name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from memfit.categories import Category

__all__ = ["Record", "Site", "plain", "scaled_bytes", "float8_tensor_type", "storage_events", "managed_peak", "ALLOC",
           "FREE", "SPIKE", "MARK", "RENAME", "KEPT", "MANAGED"]

ALLOC, FREE, SPIKE, MARK = 0, 1, 2, 3
# What ``storage_events`` makes of an ALLOC and a FREE under the donated-gradient rule, and of one
# of managed memory (no device bytes of the allocator).
RENAME, KEPT, MANAGED = 4, 5, 6
try:  # a build without torch.distributed has no DTensor
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # pragma: no cover
    _DTensor = None


@dataclass
class Record:
    """One storage: its size, the role it played, and where it was born."""

    nbytes: int
    category: Category
    phase: str
    step: int
    module: str
    donor: int | None = None  # the record whose memory this one reuses (in-place accumulation)
    donated: bool = False  # its memory went on in another record: its free releases nothing
    scaled: int = 0  # with ``Ledger.prime``: the bytes of it that scale with the batch
    # Made outside any module (parameters, optimizer state, foreach temporaries, accumulated
    # gradients): the module whose tensor it is or derives from. The depth fast path reads it.
    owner: str | None = None
    freed_in: str | None = None  # the module running when it was freed (``OUTSIDE`` if none)
    # CUDA managed memory (bitsandbytes' paged optimizer state, ``cudaMallocManaged``), not the
    # caching allocator's: the bytes of every managed buffer of its parameter (they must be on the
    # device together while that parameter is updated); 0 for device memory.
    managed: int = 0
    # With a ``placer`` (``techniques/dispatch.py``): the device this storage is on ("0", "1", "cpu",
    # "disk"); None on one device.
    device: str | None = None
    # The CUDA stream it was allocated on (0: the default stream; FSDP2's copy-in and reduce-scatter
    # streams: ``techniques/parallel.py``): the caching allocator reuses a block on its own stream only.
    stream: int = 0


@dataclass
class Site:
    """One call of an op whose kernel may allocate scratch the dispatcher never sees."""

    key: tuple
    phase: str
    step: int
    module: str
    spec: list = field(repr=False)  # how to rebuild the call with real tensors
    arg_records: list = field(default_factory=list)  # ledger record of each tensor leaf, or None
    out_records: list = field(default_factory=list)  # ledger record of each fresh output, or None
    out_metas: list = field(default_factory=list)  # (shape, stride, dtype) of each output


_FLOAT8: list = []  # torchao's Float8TrainingTensor, once it has been loaded


def float8_tensor_type():
    """torchao's ``Float8TrainingTensor`` (float8 training's wrapper of a float8 payload and its scale), if
    torchao's float8 is loaded (nothing is imported for it: a step without float8 never loads it). Asked of
    every op and output: the class is kept once found."""
    if _FLOAT8:
        return _FLOAT8[0]
    import sys

    found = getattr(sys.modules.get("torchao.float8.float8_training_tensor"), "Float8TrainingTensor", None)
    if found is not None:
        _FLOAT8.append(found)
    return found


def plain(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``tensor``'s memory: itself, or for a ``DTensor`` (FSDP2's
    parameters, gradients and optimizer state) its local tensor, whose storage the allocator saw; for
    torchao's ``Float8TrainingTensor`` its float8 payload and scale, for its ``NF4Tensor`` (a QLoRA weight)
    its packed codes, scalers and their factors. An op on a wrapper runs its inner ops below
    this mode; their outputs are seen here, inside the wrapper the op returns."""
    if _DTensor is not None and isinstance(tensor, _DTensor):
        return plain(tensor._local_tensor)
    float8 = float8_tensor_type()
    if float8 is not None and isinstance(tensor, float8):
        return plain(tensor._data) + plain(tensor._scale)
    if type(tensor).__name__ == "NF4Tensor" and hasattr(tensor, "__tensor_flatten__"):  # QLoRA's torchao weight
        names, _ = tensor.__tensor_flatten__()
        return [t for name in names for t in plain(getattr(tensor, name))]
    return [tensor]


def storage_events(ledger):
    """``ledger.events`` as device memory sees them: the donated-gradient rule, in one place.

    A record with a ``donor`` was made by an add that a plain run does in place (``Ledger``'s
    ``_accumulation_donor``): its ALLOC takes over the donor's storage and adds no bytes, so it comes
    out as ``(RENAME, index)``; the donor's later FREE releases nothing (its memory lives on in that
    record), so it comes out as ``(KEPT, index)``. Managed memory (``Record.managed``) is not device
    memory of the allocator: its events come out as ``(MANAGED, index)``, which moves no device
    bytes (``managed_peak`` counts them). Every other event comes out as it is.
    ``ledger``: anything with ``.records`` and ``.events``, as ``Ledger`` has them."""
    records = ledger.records
    for kind, index in ledger.events:
        if kind in (ALLOC, FREE) and getattr(records[index], "managed", 0):
            yield MANAGED, index
        elif kind == ALLOC and records[index].donor is not None:
            yield RENAME, index
        elif kind == FREE and records[index].donated:
            yield KEPT, index
        else:
            yield kind, index


def managed_peak(ledger) -> tuple[int, int]:
    """(highest live bytes of managed memory over the run, the largest set of managed buffers one
    parameter's update needs on the device at once), from ``Record.managed``; (0, 0) without any."""
    records, live, peak = ledger.records, 0, 0
    for kind, index in ledger.events:
        if kind in (ALLOC, FREE) and getattr(records[index], "managed", 0):
            live += records[index].nbytes if kind == ALLOC else -records[index].nbytes
            peak = max(peak, live)
    return peak, max((getattr(r, "managed", 0) for r in records), default=0)


def scaled_bytes(tensor: torch.Tensor, prime: int) -> int:
    """The bytes of ``tensor``'s storage that scale with the batch when the batch has ``prime`` rows.

    A dimension that is a multiple of the prime is a batch dimension; the storage spans
    ``1 + sum((size - 1) * stride)`` elements, which is affine in the batch, so a view's storage
    (a slice of a bigger buffer, laid out again) splits exactly into a scaled and a fixed part.
    """
    if not tensor.numel():
        return 0
    slope = sum((size // prime) * stride for size, stride in zip(tensor.shape, tensor.stride()) if size % prime == 0)
    return slope * prime * tensor.element_size()
