"""Values a script reads back from fake tensors: plausible placeholders, never a crash.

A fake tensor has shapes and no values. ``.item()``, ``float(t)``, ``bool(t)`` go through
``estimator/fake.ScalarReads`` (zero, no inf found, masks all true); this function mode answers the reads
that never reach the dispatcher as an op: ``f"{loss:.4f}"`` (``Tensor.__format__``, which a tensor subclass
does not format itself), ``.tolist()`` and ``.numpy()`` (zeros of the tensor's shape and dtype).
``reads`` counts the placeholders handed out.

Host-side values stay real where they drive the script's own arithmetic: an integer tensor made on the
host (``torch.randint`` of sample offsets, ``torch.arange``), a tensor made from Python numbers
(``torch.tensor(0.0)``: an optimizer's step count, whose value Adam divides by) and every op whose
tensor arguments are all real run for real, outside fake tensor mode (``i + block_size`` of a real offset
slices the memmap as the script means it; a placeholder would make an empty batch). Their storages are
entered in the ledger (the CPU allocator counts them in a real run; on a card they are the host's).
Floating-point tensors made on the host stay fake: a model built on the CPU before ``.to('cuda')`` costs
no memory.

Left out: values that drive the run (a loss compared with a threshold takes the branch zero takes).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils._python_dispatch import _disable_current_modes

from memfit.categories import Category

__all__ = ["Values"]


def _numpy_dtype(dtype):
    import numpy

    return {torch.bfloat16: numpy.float32, torch.bool: numpy.bool_}.get(
        dtype, getattr(numpy, str(dtype).replace("torch.", ""), numpy.float32))


_INTEGER_FACTORIES = {torch.randint, torch.randperm, torch.arange, torch.tensor, torch.as_tensor, torch.from_numpy}


def _names_card(args, kwargs) -> bool:
    from memfit.script.device import is_cuda

    return any(is_cuda(value) for value in (*args, kwargs.get("device"))) or is_cuda(torch.get_default_device())


class Values(TorchFunctionMode):
    """``ledger``: where real host storages are entered (set once it exists); ``host``: the ``Record.device``
    they get (``"cpu"`` on a card, None under CPU semantics, where all is one memory)."""

    def __init__(self):
        super().__init__()
        self.reads = 0
        self.ledger = None
        self.host = None
        tensor = torch.Tensor
        self._answers = {tensor.__format__: self._format, tensor.tolist: self._tolist, tensor.numpy: self._numpy}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        answer = self._answers.get(func)
        if answer is not None and args and isinstance(args[0], FakeTensor):
            self.reads += 1
            return answer(*args, **kwargs)
        if self.ledger is not None and self._real(func, args, kwargs):
            with _disable_current_modes():
                out = func(*args, **kwargs)
            self._enter(out)
            return out
        return func(*args, **kwargs)

    def _real(self, func, args, kwargs) -> bool:
        """A host op on real values: no fake tensor in, not for the card, an integer factory or real tensors in."""
        if torch._C._current_autograd_node() is not None:
            return False
        flat = tree_flatten((args, kwargs))[0]
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        if any(isinstance(t, FakeTensor) or t.requires_grad for t in tensors) or _names_card(args, kwargs):
            return False
        if func in (torch.tensor, torch.as_tensor) and not tensors:
            return True  # from Python numbers: small, and their values are meant (an optimizer's step count)
        if func in _INTEGER_FACTORIES:
            dtype = kwargs.get("dtype")
            return dtype is None or not dtype.is_floating_point
        return bool(tensors) and all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)

    def _enter(self, out) -> None:
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and not isinstance(tensor, FakeTensor) and tensor.device.type == "cpu":
                record = self.ledger.record_of(tensor)
                if record is None:
                    self.ledger.register(tensor, Category.TEMPORARIES)
                    record = self.ledger.record_of(tensor)
                    if record is not None:
                        record.device = self.host

    @staticmethod
    def _zero(tensor):
        return False if tensor.dtype == torch.bool else 0.0 if tensor.is_floating_point() else 0

    def _format(self, tensor, spec=""):
        if tensor.dim() == 0:
            return format(self._zero(tensor), spec)
        return f"tensor(shape={list(tensor.shape)}, dtype={tensor.dtype}, values not simulated)"

    def _tolist(self, tensor):
        return self._numpy(tensor).tolist()

    def _numpy(self, tensor, *, force=False):
        import numpy

        return numpy.zeros(tuple(tensor.shape), dtype=_numpy_dtype(tensor.dtype))
