"""Tensor subclasses whose own ``__torch_dispatch__`` runs below the ledger's mode: DTensor's Python op handlers
(``loss_parallel``'s cross-entropy, a convolution, the GradScaler's inf check) and torchao's
``Float8TrainingTensor``. Called below the mode, their inner ops would allocate where the ledger cannot see
them; so the ledger runs each with itself pushed back on the mode stack (``SubclassDispatch._handled``), and
records their ops like any other. A DTensor's kernels run on its local shard (``local``).

Left out: DTensor's sharding propagation, whose global-shape fake run is no memory in a real run (kept out of
sight), and every subclass that dispatches to plain aten ops on its own (seen as they are).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import _pop_mode, _push_mode
from torch.utils._pytree import tree_flatten

from memfit.accounting.events import _DTensor, float8_tensor_type, plain
from memfit.scoped import patched

__all__ = ["dtensor_handler", "wrapper_handler", "local", "SubclassDispatch"]


def dtensor_handler(func, args, kwargs):
    """DTensor's own Python handler of ``func`` on DTensor arguments (``loss_parallel``'s cross-entropy, a
    convolution, the GradScaler's inf check), or None. Called below this mode, a handler's inner ops would
    allocate where the ledger cannot see them (its temporaries: the loss-parallel step was 4 % low); run
    with the ledger pushed back, each of them is recorded like any other op."""
    if _DTensor is None:
        return None
    handler = _DTensor._op_dispatcher._custom_op_handlers.get(func)  # a few ops: looked up before any flattening
    if handler is None or not any(isinstance(a, _DTensor) for a in tree_flatten((args, kwargs))[0]):
        return None
    return handler


def wrapper_handler(types):
    """The ``__torch_dispatch__`` of torchao's ``Float8TrainingTensor`` when it is among the op's argument types,
    or None. Called below this mode, it dequantises, scales and multiplies in ops the ledger would not see (a
    float8 MLP's step was 30 KB under the CPU allocator); run with the ledger pushed back, they are recorded."""
    float8 = float8_tensor_type()
    if float8 is None or not any(issubclass(t, float8) for t in types):
        return None
    return lambda func, args, kwargs: float8.__torch_dispatch__(func, types, args, kwargs)


def local(value):
    """A DTensor's local shard (what its kernels run on); anything else as it is."""
    return plain(value)[0] if isinstance(value, torch.Tensor) else value


class SubclassDispatch:
    """The ledger's part that runs a subclass's handler with the ledger pushed back (``_handlers``: how many run
    now; an add inside one is not autograd's accumulation)."""

    def _handled(self, handler, func, args, kwargs):
        """``handler(func, args, kwargs)`` with this mode pushed back, so its inner ops are recorded; but not
        the global-shape fake run DTensor's sharding propagation makes to learn the output's shape (in a real
        run those are fake tensors, no memory)."""
        propagator = getattr(getattr(_DTensor, "_op_dispatcher", None), "sharding_propagator", None)
        shapes = getattr(propagator, "_propagate_tensor_meta", None)  # another torch may name it otherwise

        def unseen(*a, **k):
            mode = _pop_mode()
            try:
                return shapes(*a, **k)
            finally:
                _push_mode(mode)

        _push_mode(self)
        self._handlers += 1
        try:
            with patched(propagator, "_propagate_tensor_meta", unseen) if shapes is not None \
                    else contextlib.nullcontext():
                return handler(func, args, kwargs)
        finally:
            self._handlers -= 1
            _pop_mode()
