"""Data-dependent shapes in a user's script, on fake tensors: each one at its upper bound, counted for a note.

A fake tensor has no values, so an op whose output size depends on them (``nonzero``, ``torch.where(cond)``,
``x[mask]``, ``x[mask] = v``, ``masked_select``, ``unique``) has no size: fake tensor mode refuses it. Memory
needs one, and a fit needs the worst one: every element selected (``nonzero`` of N elements gives N rows, a
boolean mask keeps every row, ``unique`` finds every element distinct). This mode gives those sizes, below
memfit's ledger (which records the outputs) and above fake tensor mode (which then sees only sizes it knows).

Left out: the scratch these ops' kernels allocate inside themselves (measured on this CPU: ``masked_select``
copies its mask, one input's worth; ``unique`` sorts, about four; CUDA's run ``nonzero`` first); a mixture of
experts' routing as ``--moe-routing balanced`` models it for memfit's own models
(here a router's ``torch.where(expert_mask)`` keeps every token for every expert, the upper bound: an
overestimate for top-k routing, said in the note); ``repeat_interleave`` with tensor repeats and
``bincount`` (their sizes read values: refused in one line).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["UpperBounds"]

_aten = torch.ops.aten


def _masks_to_positions(indices):
    """Boolean (or uint8) masks in an index list become long position tensors of every element's position."""
    out = []
    for index in indices:
        if isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8):
            out.extend(torch.empty(index.numel(), dtype=torch.long) for _ in range(max(index.dim(), 1)))
        else:
            out.append(index)
    return out


class UpperBounds(TorchDispatchMode):
    """``taken``: how many data-dependent sizes were given their upper bound."""

    def __init__(self):
        super().__init__()
        self.taken = 0

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten.nonzero.default:
            self.taken += 1
            return torch.empty((args[0].numel(), args[0].dim()), dtype=torch.long)
        if func is _aten.masked_select.default:
            self.taken += 1
            values, mask = args[0], args[1]
            return torch.empty(torch.broadcast_shapes(values.shape, mask.shape).numel(), dtype=values.dtype)
        if func in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default):
            indices = args[1]
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
                self.taken += 1
                args = (args[0], _masks_to_positions(indices), *args[2:])
        if func is _aten._unique2.default:
            self.taken += 1
            source = args[0]
            inverse = kwargs.get("return_inverse", args[2] if len(args) > 2 else False)
            counts = kwargs.get("return_counts", args[3] if len(args) > 3 else False)
            return (torch.empty(source.numel(), dtype=source.dtype),
                    torch.empty(source.shape if inverse else (0,), dtype=torch.long),
                    torch.empty(source.numel() if counts else 0, dtype=torch.long))
        return func(*args, **kwargs)
