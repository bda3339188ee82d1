"""Models and batches made of fake tensors: shapes, dtypes and devices, no memory.

A model built by a factory is built on the meta device (no memory, no initialisation cost) and
its parameters and buffers are then turned into fake tensors of the target device; building
directly inside ``FakeTensorMode`` breaks modules that deep-copy themselves
(``nn.TransformerEncoder``: "Mixing fake modes NYI"). A ready module is deep-copied with every
parameter and buffer swapped for a fake twin, so the user's model is never touched.
"""

from __future__ import annotations

import contextlib
import copy
import logging

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

from memfit.scoped import rng_hop_rules
from memfit.techniques.lora import pending_settings

__all__ = ["fake_copy", "build_fake", "fake_batch", "ScalarReads", "quiet_fake_log"]


@contextlib.contextmanager
def quiet_fake_log():
    """Silence torch's fake-tensor logger while a fake step runs, then restore it.

    When an op fails on fake tensors torch logs the exception with its traceback
    (``log.exception("fake tensor raised TypeError")``) before raising it; memfit turns the
    exception itself into one line, so the logged traceback is noise."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    before = log.disabled
    log.disabled = True
    try:
        yield
    finally:
        log.disabled = before


def _fake_param(mode: FakeTensorMode, tensor: torch.Tensor, device: torch.device, cache: dict, dtype=None):
    key = id(tensor)
    if key not in cache:
        # Cast here, not with module.to(): swapping a fake parameter in place is refused.
        cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        if tensor.device.type == "meta":
            meta = tensor.detach().to(cast)
            fake = mode.fake_tensor_converter.from_meta_and_device(mode, meta, device)
        else:
            fake = mode.from_tensor(tensor.detach())
            if cast != tensor.dtype:
                with mode:
                    fake = fake.to(cast)
        if isinstance(tensor, torch.nn.Parameter):
            fake = torch.nn.Parameter(fake, requires_grad=tensor.requires_grad)
            settings = pending_settings(tensor)  # a bitsandbytes 4-bit weight: quantised before the step
            for name, value in dict(settings or {}, bnb_quantized=False).items() if settings else ():
                setattr(fake, name, value)
        cache[key] = fake
    return cache[key]


def fake_copy(module: torch.nn.Module, mode: FakeTensorMode, dtype=None) -> torch.nn.Module:
    """A deep copy of ``module`` whose parameters and buffers are fake (ties kept), floating
    point ones cast to ``dtype`` if given."""
    cache: dict = {}
    memo: dict = {}
    for tensor in list(module.parameters()) + list(module.buffers()):
        memo[id(tensor)] = _fake_param(mode, tensor, tensor.device, cache, dtype)
    return copy.deepcopy(module, memo)


def build_fake(build, mode: FakeTensorMode, device: torch.device, dtype=None) -> torch.nn.Module:
    """Call ``build()`` on the meta device, then make its tensors fake tensors on ``device``
    (floating point ones cast to ``dtype`` if given)."""
    with torch.device("meta"):
        module = build()
    cache: dict = {}
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None:
                sub._parameters[name] = _fake_param(mode, param, device, cache, dtype)
        for name, buf in list(sub._buffers.items()):
            if buf is not None:
                sub._buffers[name] = _fake_param(mode, buf, device, cache, dtype)
        for name, value in list(vars(sub).items()):
            if isinstance(value, torch.Tensor) and value.device.type == "meta":
                setattr(sub, name, _fake_param(mode, value, device, cache, dtype))
    return module


def fake_batch(batch, mode: FakeTensorMode):
    """Real tensors in ``batch`` become fake ones; a callable is called inside the mode."""
    if callable(batch):
        with mode:
            return batch()
    return tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, batch)


_WAIT = getattr(getattr(torch.ops, "_c10d_functional", None), "wait_tensor", None)
_WAIT = getattr(_WAIT, "default", None) if _WAIT is not None else None


class ScalarReads(TorchDispatchMode):
    """Answers ``tensor.item()`` on a fake tensor that has no value with zero.

    Optimizers and loops read scalars (Adafactor's ``param.norm().item()``, a GradScaler's
    ``found_inf.item()``, a logged ``loss.item()``); on fake tensors there is no value to read.
    Memory does not depend on these values, only on the branch a read may choose, so each read
    takes the common branch of a training step: zero (no inf found, nothing skipped), False for
    ``any`` and True for ``all`` (no padding: Hugging Face skips building a 4-D attention mask
    only after ``(mask == 1).all()`` reads True; LLaVA checks its image-token count with
    ``torch._check_tensor_all``). ``reads`` counts how often it answered.

    Also: a functional collective's ``wait_tensor`` gives back its input, as it does on a real process group
    (FakeTensorMode makes a new tensor of it, which counted each DTensor redistribution's result twice:
    one gathered logits tensor too many at tensor parallelism's peak).
    """

    def __init__(self, kernels=None):
        super().__init__()
        self.reads = 0
        self._all = WeakIdKeyDictionary()
        # ``CpuKernels`` run inside this mode rather than as a mode of its own below it: each mode on the
        # stack costs every op a trip through Python (~3 % of a fake trace each)
        self.kernels = kernels
        self._routed = None

    def __enter__(self):
        if self.kernels is not None:
            self._routed = self.kernels.routed()
            self._routed.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._exit_routing(None, None, None)
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._exit_routing(*exc)

    def _exit_routing(self, *exc):
        routed, self._routed = self._routed, None
        if routed is not None:
            routed.__exit__(*exc)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # a compiled step runs under it; compiling is not part of the step

    # A ``Ledger`` pushed directly above takes this mode off the stack while it is pushed and calls its
    # ``__torch_dispatch__`` inside its own (one Python mode less per op); a subclass's override is called the same way
    inline_under_ledger = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _WAIT and args:
            return args[0]
        if func is torch.ops.aten._local_scalar_dense.default:
            tensor = args[0]
            if getattr(tensor, "constant", None) is None:
                self.reads += 1
                if tensor.dtype == torch.bool:
                    return tensor in self._all
                return 0.0 if tensor.is_floating_point() else 0
        out = func(*args, **(kwargs or {})) if self.kernels is None else self.kernels.handle(func, args, kwargs)
        # torch._check_tensor_all (transformers' torch_compilable_check) reads ``_is_all_true``.
        if func.overloadpacket in (torch.ops.aten.all, torch.ops.aten._is_all_true) and isinstance(out, torch.Tensor):
            self._all[out] = True
        # a count compared with zero reads True, as the count itself reads 0 (I-BERT asserts
        # ``x.isnan().sum() == 0`` on every activation)
        if (func is torch.ops.aten.eq.Scalar and isinstance(out, torch.Tensor) and len(args) == 2
                and not isinstance(args[1], bool) and args[1] == 0 and not args[0].is_floating_point()):
            self._all[out] = True
        return out


rng_hop_rules(ScalarReads)  # a compiled step's RNG operators run under it (``memfit.scoped``)
