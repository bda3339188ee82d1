"""A virtual memory budget: real tensors under a byte cap, so OOM handling is tested without a GPU.

Inside ``VirtualBudget(limit)`` every aten op runs for real; each fresh output storage is counted
while it lives (a ``weakref.finalize`` on the storage uncounts it, as the ledger does). When an op's
new storages would take the live total past ``limit``, its outputs are dropped and
``torch.OutOfMemoryError`` is raised, the error a CUDA run raises, so the code that catches it is the
code that runs on a GPU. ``resident`` adds bytes allocated before the budget opened (the model's
parameters, say) so the cap is on the whole process's tensors, as a card's is.

Fault injection: ``inject`` names places — ``(step, micro_batch, phase)`` or ``(step, micro_batch,
phase, nth)`` — where the ``nth`` allocation (default the first) fails once, whatever the budget.
The code under test says where it is with ``at(step, micro_batch, phase)``; a place fires once, so a
retry of the same place succeeds (as a retry after freeing memory would).

What it cannot see: scratch a kernel allocates inside itself (oneDNN, bf16 reorders on CPU), as the
ledger cannot (``accounting/ledger.py``). On CUDA the real cap is
``torch.cuda.set_per_process_memory_fraction``; this is for CPU runs and tests.

Why by hand: torch has no per-process byte cap for CPU tensors, and its CPU allocator has no Python
hook; a dispatch mode is the one place every allocation passes.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.errors import MemfitError
from memfit.units import format_size, parse_size

__all__ = ["VirtualBudget", "PHASES"]

PHASES = ("forward", "backward", "optimizer")
_BORN = {torch.ops.aten.lift_fresh.default}  # torch.tensor(data): fresh memory under an alias annotation


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)


class VirtualBudget(TorchDispatchMode):
    """Count live tensor bytes made inside; raise ``torch.OutOfMemoryError`` past ``limit``.

    limit     bytes or a size (``"64MiB"``); None: no cap (fault injection only)
    resident  bytes already held outside the budget that count against it
    inject    places where one allocation fails: ``(step, micro_batch, phase[, nth])``
    """

    def __init__(self, limit=None, *, resident: int = 0, inject=()):
        super().__init__()
        self.limit = None if limit is None else parse_size(limit)
        if self.limit is not None and self.limit <= 0:
            raise MemfitError(f"a virtual budget must be positive, got {limit!r}")
        self.resident = int(resident)
        self.live = 0
        self.peak = 0
        self.raised = 0  # OutOfMemoryErrors raised, cap and injected together
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes, while it lives
        self._faults = {}
        for place in inject:
            step, micro, phase, *nth = place
            if phase not in PHASES:
                raise MemfitError(f"unknown phase {phase!r} in a fault: choose one of {', '.join(PHASES)}")
            self._faults[(int(step), int(micro), phase)] = int(nth[0]) if nth else 1
        self._where = None
        self.allocations = 0  # allocations at the current place (since the last ``at``)
        self.fired: list[tuple] = []

    def at(self, step: int, micro_batch: int, phase: str) -> None:
        """Where the code under test is now (for fault injection)."""
        self._where = (int(step), int(micro_batch), phase)
        self.allocations = 0

    @property
    def where(self) -> tuple | None:
        """The place last told with ``at``: ``(step, micro_batch, phase)``."""
        return self._where

    @property
    def total(self) -> int:
        """The bytes the cap applies to: what is live inside plus ``resident``."""
        return self.live + self.resident

    def _uncount(self, key: int, nbytes: int) -> None:
        if self._sizes.pop(key, None) is not None:
            self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        flat = out if isinstance(out, (tuple, list)) else (out,)
        fresh, born = [], func in _BORN
        for position, value in enumerate(flat):
            if not born and position < len(returns) and returns[position].alias_info is not None:
                continue  # a view or an in-place result: no new memory
            for tensor in _tensors(value):
                storage = tensor.untyped_storage()
                if id(storage) not in self._sizes and storage.nbytes():
                    fresh.append(storage)
        if not fresh:
            return out
        new = sum(s.nbytes() for s in fresh)
        self.allocations += 1
        place = self._where
        if place is not None and self._faults.get(place) == self.allocations:
            del self._faults[place]
            self.fired.append(place)
            self.raised += 1
            raise torch.OutOfMemoryError(f"memfit virtual budget: injected out-of-memory at step {place[0]}, "
                                         f"micro-batch {place[1]}, {place[2]} (allocation {self.allocations})")
        if self.limit is not None and self.total + new > self.limit:
            self.raised += 1
            raise torch.OutOfMemoryError(
                f"memfit virtual budget: tried to allocate {format_size(new)} with {format_size(self.total)} of "
                f"{format_size(self.limit)} in use")
        for storage in fresh:
            nbytes = storage.nbytes()
            key = id(storage)
            self._sizes[key] = nbytes
            weakref.finalize(storage, self._uncount, key, nbytes)
        self.live += new
        self.peak = max(self.peak, self.total)
        return out
