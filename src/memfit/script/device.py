"""The card a user's script asks for, answered on fake CPU tensors: ``'cuda'`` is the card memfit models.

A CPU build of torch makes fake tensors on ``cuda:0`` but cannot run their backward (autograd asks the
CUDA runtime for the device), and torch's CUDA kernels would pick their own attention and autocast paths
anyway; memfit's CUDA semantics (``hardware/cuda.py``) are written for fake *CPU* tensors. So every
tensor a script puts on ``cuda`` is a fake CPU tensor that memfit remembers as the card's, and every place
a script can ask about the card is answered as that card would answer:

* **Where tensors go** (``_OnCard``, a ``TorchFunctionMode``): a ``device`` argument naming ``cuda``
  (a string, ``torch.device``, an index to ``.to``/``.cuda``) becomes ``cpu`` and the call's new storages
  the card's; ``.cuda()``, ``.to('cuda')`` of a host tensor copy it (the card's allocation); ``.cpu()`` of
  a card tensor copies it back to the host; ``.device`` / ``.is_cuda`` of a card tensor say ``cuda:N``,
  so ``torch.zeros(..., device=x.device)`` lands on the card again. ``torch.set_default_device('cuda')``
  and ``with torch.device('cuda')`` go through the same mode (torch's ``DeviceContext`` adds the device).
* **Which storages are the card's** (``_Placer``, the ledger's placer): an op's new storages are the
  card's when the call named the card, else when any tensor argument is the card's; a factory with no
  tensor argument is the card's inside autograd's backward or under a default device of ``cuda``; all else
  is the host's (data loading, numpy), which the card's figures leave out.
* **What ``torch.cuda`` answers**: the card (``cuda_api.py``), its memory counters from memfit's
  caching allocator fed the card's events so far.
* **amp**: ``torch.autocast('cuda')`` (and ``torch.cuda.amp.autocast``) is CPU autocast under CUDA
  semantics (which give it CUDA's op lists); GradScalers run on the fake tensors (their ``found_inf``
  reads zero: no step skipped).
* **Optimizers** pick foreach (or fused) as they would on CUDA: torch's default for a list of CUDA
  tensors is foreach, which a fake tensor does not get by itself.

Left out: ``pin_memory`` (a no-op: pinned host memory is not the card's); several devices in one process
(``cuda:1`` is the same card as ``cuda:0``: a script runs as one rank).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from memfit.errors import MemfitError
from memfit.scoped import patched
from memfit.script.cuda_api import Counters, CudaApi

__all__ = ["FakeCuda", "is_cuda", "swap_or_set", "counted_dispatch", "forget_devices", "cuda_hidden"]

# "card" / "host": where the storages of the call in progress go, when the call named a device
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("memfit_script_target", default=None)
HOST = "cpu"  # Record.device of a host storage (the card's are None)


def is_cuda(value) -> bool:
    """``value`` names a CUDA device (a string or ``torch.device``)."""
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return isinstance(value, str) and value.split(":")[0] == "cuda"


def _is_cpu(value) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cpu"
    return isinstance(value, str) and value.split(":")[0] == "cpu"


def _to_cpu(value):
    return torch.device("cpu") if isinstance(value, torch.device) else "cpu"


class _Placer:
    """The ledger's placer (``Ledger.placer``): each new storage is the card's (``device=None``) or the host's."""

    def __init__(self, shim: "FakeCuda"):
        self.shim = shim

    def on_card(self, ledger, tensor) -> bool:
        record = ledger.record_of(tensor)
        return record is not None and record.device is None

    def _where(self, ledger, args, kwargs) -> str:
        target = _TARGET.get()
        if target is not None:
            return target
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if tensors:
            return "card" if any(self.on_card(ledger, t) for t in tensors) else "host"
        if self.shim.default_on_card() or torch._C._current_autograd_node() is not None:
            return "card"
        return "host"

    def place(self, ledger, args, kwargs, made, many) -> None:
        device = None if self._where(ledger, args, kwargs) == "card" else HOST
        for _, index in made:
            ledger.records[index].device = device

    def device_of(self, ledger, args, kwargs):
        """The cuBLAS handle's device of a matmul: the card's (None), or the host (no workspace on the card)."""
        return None if self._where(ledger, args, kwargs) == "card" else HOST

    def own(self, ledger) -> None:
        return None


class _OnCard(TorchFunctionMode):
    """Rewrites the script's ``cuda`` into ``cpu`` and says which calls make the card's storages."""

    def __init__(self, shim: "FakeCuda"):
        super().__init__()
        self.shim = shim
        tensor = torch.Tensor
        # ``.device`` of a fake tensor is FakeTensor's own property (``_fake_device_says_cuda``); ``.is_cuda`` comes here
        self._is_cuda_get = tensor.is_cuda.__get__
        self._special = {tensor.to: self._to, tensor.cuda: self._cuda, tensor.cpu: self._cpu,
                         tensor.pin_memory: lambda t, *a, **k: t, tensor.is_pinned: lambda t, *a, **k: True,
                         tensor.record_stream: lambda t, *a, **k: None,
                         tensor.get_device: lambda t: self.shim.current if self._on_card(t) else -1,
                         # Module.to parses its arguments first: the device it names is the one to move to
                         torch._C._nn._parse_to: torch._C._nn._parse_to,
                         torch.device: torch.device}  # making a device object is not moving a tensor

    def _on_card(self, tensor) -> bool:
        ledger = self.shim.ledger
        return ledger is not None and isinstance(tensor, torch.Tensor) and self.shim.placer.on_card(ledger, tensor)

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == self._is_cuda_get:  # a new method-wrapper each time: equal, not identical
            return self._on_card(args[0])
        special = self._special.get(func)
        if special is not None:
            return special(*args, **kwargs)
        target = None
        if "device" in kwargs:
            if is_cuda(kwargs["device"]):
                kwargs, target = dict(kwargs, device=_to_cpu(kwargs["device"])), "card"
            elif _is_cpu(kwargs["device"]):
                target = "host"
        if any(is_cuda(a) for a in args if isinstance(a, (str, torch.device))):
            args, target = tuple(_to_cpu(a) if is_cuda(a) else a for a in args), "card"
        return self._call(target, func, args, kwargs)

    @staticmethod
    def _call(target, func, args, kwargs):
        if target is None:
            return func(*args, **kwargs)
        token = _TARGET.set(target)
        try:
            return func(*args, **kwargs)
        finally:
            _TARGET.reset(token)

    # -- moving tensors --------------------------------------------------------------------------
    def _move(self, tensor, to_card: bool, dtype=None, non_blocking=False, copy=False, memory_format=None):
        """``tensor`` on the card (or the host): a copy when it is not there yet, as a real move is."""
        here = self._on_card(tensor)
        options = {"non_blocking": non_blocking}
        if memory_format is not None:
            options["memory_format"] = memory_format
        if dtype is not None:
            options["dtype"] = dtype
        move = here != to_card
        return self._call("card" if to_card else "host", torch.Tensor.to, (tensor, "cpu"),
                          dict(options, copy=bool(copy or move)))

    def _to(self, tensor, *args, **kwargs):
        first = args[0] if args else kwargs.get("other", None)
        if isinstance(first, torch.Tensor):  # .to(other): other's device and dtype
            rest = dict(kwargs)
            rest.pop("other", None)
            return self._move(tensor, self._on_card(first), dtype=first.dtype,
                              non_blocking=args[1] if len(args) > 1 else rest.get("non_blocking", False),
                              copy=args[2] if len(args) > 2 else rest.get("copy", False))
        copy = kwargs.pop("copy", False)
        if len(args) >= 4 and isinstance(args[3], bool):  # to(device, dtype, non_blocking, copy)
            args, copy = args[:3], args[3]
        cuda_index = [isinstance(a, int) and not isinstance(a, bool) for a in args[:1]]
        parsed = [_to_cpu(a) if is_cuda(a) else a for a in args]
        if cuda_index and cuda_index[0]:
            parsed[0] = "cpu"
        where = kwargs.get("device", args[0] if args and (isinstance(args[0], (str, torch.device)) or
                                                            cuda_index[0]) else None)
        if "device" in kwargs:
            kwargs = dict(kwargs, device="cpu")
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*parsed, **kwargs)
        if where is None:  # a cast: the copy stays where the tensor is
            return self._move(tensor, self._on_card(tensor), dtype, non_blocking, copy, memory_format) \
                if dtype is not None or copy or memory_format is not None else tensor
        to_card = is_cuda(where) or (isinstance(where, int) and not isinstance(where, bool))
        return self._move(tensor, to_card, dtype, non_blocking, copy, memory_format)

    def _cuda(self, tensor, device=None, non_blocking=False, memory_format=None):
        return self._move(tensor, True, non_blocking=non_blocking, memory_format=memory_format)

    def _cpu(self, tensor, memory_format=None):
        return self._move(tensor, False, memory_format=memory_format)


class FakeCuda:
    """While active, the script's ``cuda`` is ``card`` (a catalog ``GPU``), ``gpus`` of them.

    ``attach(ledger)`` once the ledger exists: where the card's storages are recorded (this shim's placer
    becomes its ``placer``). ``api``: what ``torch.cuda`` answers (``cuda_api.py``)."""

    def __init__(self, card, *, gpus: int = 1):
        self.card = card
        self.ledger = None
        self.dispatching = 0  # depth of the fake mode's own dispatch (``counted_dispatch``)
        self.plain_devices = 0  # inside compiled calls (``compiled_call``): tensor.device tells the truth
        self.placer = _Placer(self)
        self.api = CudaApi(card, gpus, Counters(lambda record: record.device is None))
        self._scope = None

    @property
    def current(self) -> int:
        return self.api.current

    @contextlib.contextmanager
    def compiled_call(self, args, kwargs):
        """Around a compiled call: ``tensor.device`` says ``cpu`` (what dynamo and Inductor see), and the call's
        storages are the card's when any tensor argument (or, for a module, parameter) is."""
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_card = self.ledger is not None and any(self.placer.on_card(self.ledger, t) for t in tensors)
        self.plain_devices += 1
        token = _TARGET.set("card") if on_card else None
        try:
            yield
        finally:
            self.plain_devices -= 1
            if token is not None:
                _TARGET.reset(token)

    def attach(self, ledger) -> None:
        self.ledger = self.api.counters.ledger = ledger
        ledger.placer = self.placer
        ledger.cublas_workspace = self.card.cublas_workspace_bytes
        ledger.follow(self.card)

    def default_on_card(self) -> bool:
        return is_cuda(torch.get_default_device())

    def __enter__(self) -> "FakeCuda":
        with contextlib.ExitStack() as scope:
            scope.enter_context(self.api)
            scope.enter_context(_autocast_on_cpu())
            scope.enter_context(_optimizers_as_on_cuda(self))
            scope.enter_context(_fake_device_says_cuda(self))
            scope.enter_context(_OnCard(self))
            self._scope = scope.pop_all()
        return self

    def __exit__(self, *exc):
        self._scope.close()
        return False


@contextlib.contextmanager
def _fake_device_says_cuda(shim: "FakeCuda"):
    """``tensor.device`` of the card's fake tensor is ``cuda:N`` where the script reads it (``FakeTensor``'s own
    Python property, which no function mode sees); inside fake tensor mode's dispatch (its device propagation
    and metadata, counted by ``shim.dispatching``) it stays the CPU's."""
    from torch._subclasses.fake_tensor import FakeTensor

    plain = FakeTensor.device

    def device(self):
        where = plain.fget(self)
        if where.type == "cpu" and not shim.dispatching and not shim.plain_devices and shim.ledger is not None and \
                shim.placer.on_card(shim.ledger, self):
            return torch.device("cuda", shim.current)
        return where

    with patched(FakeTensor, "device", property(device, plain.fset)):
        yield


def counted_dispatch(mode, shim: "FakeCuda"):
    """``mode.dispatch`` (a FakeTensorMode's) counting how deep it runs in ``shim.dispatching``."""
    dispatch = mode.dispatch

    def counted(*args, **kwargs):
        shim.dispatching += 1
        try:
            return dispatch(*args, **kwargs)
        finally:
            shim.dispatching -= 1

    return patched(mode, "dispatch", counted)


@contextlib.contextmanager
def swap_or_set():
    """``Module.to`` swaps a fake parameter with its moved copy (``torch.utils.swap_tensors``), which torch
    refuses while a weak reference to it exists (fake tensor mode's converter keeps some); ``.data =`` does
    the same for two fake tensors of one class, which is what is done then."""
    from torch._subclasses.fake_tensor import FakeTensor

    swap = torch.utils.swap_tensors

    def swap_or_set(t1, t2):
        try:
            return swap(t1, t2)
        except RuntimeError:
            if not (isinstance(t1, FakeTensor) and isinstance(t2, FakeTensor)):
                raise
            with torch.no_grad():
                t1.data = t2
            return None

    with patched(torch.utils, "swap_tensors", swap_or_set):
        yield


class NoCuda(MemfitError):
    """A script asked for ``cuda`` while it runs as on a CPU-only machine (``device="cpu"``)."""


class _CpuOnly(TorchFunctionMode):
    """Refuses ``cuda`` as a CPU-only build of torch would, in one line: fake tensor mode itself would make fake
    CUDA tensors, whose first kernel that asks for the device aborts the process."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.device and (func is torch.Tensor.cuda or any(is_cuda(v) for v in (*args, *kwargs.values()))):
            raise NoCuda("the script asks for cuda, and CPU semantics (--device cpu, MEMFIT_DEVICE=cpu) run it as on a "
                         "machine without one: let its device follow torch.cuda.is_available(), or estimate for a card "
                         "(--gpu NAME)")
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_hidden():
    """CPU semantics: the script sees no CUDA device, as on a CPU-only machine, and cannot make CUDA tensors."""
    with patched(torch.cuda, "is_available", lambda: False), patched(torch.cuda, "device_count", lambda: 0), \
            _CpuOnly():
        yield


def forget_devices() -> None:
    """Forget what transformers and accelerate cached about the devices of this process (``lru_cache``-d
    availability checks, accelerate's process-wide state): a run for the card, or for the CPU, asks afresh."""
    import sys

    for owner in ("PartialState", "AcceleratorState", "GradientState"):
        state = getattr(sys.modules.get("accelerate.state"), owner, None)
        reset = getattr(state, "_reset_state", None)
        if reset is not None:
            try:
                reset(True) if owner == "AcceleratorState" else reset()
            except TypeError:
                reset()
    for name in ("transformers.utils.import_utils", "accelerate.utils.imports"):
        module = sys.modules.get(name)
        for value in vars(module).values() if module is not None else ():
            clear = getattr(value, "cache_clear", None)
            if callable(clear):
                clear()


@contextlib.contextmanager
def _autocast_on_cpu():
    """``torch.autocast('cuda', ...)`` runs as CPU autocast (CUDA semantics give it CUDA's lists)."""
    autocast = torch.amp.autocast_mode.autocast
    init = autocast.__init__

    def on_cpu(self, device_type, *args, **kwargs):
        if device_type == "cuda":
            device_type = "cpu"
            kwargs.setdefault("dtype", torch.float16)  # CUDA autocast's default; the CPU's is bf16
        init(self, device_type, *args, **kwargs)

    with patched(autocast, "__init__", on_cpu):
        yield


@contextlib.contextmanager
def _optimizers_as_on_cuda(shim: FakeCuda):
    """torch.optim's choice of implementation as for CUDA tensors: a fake parameter is not a plain
    ``torch.Tensor``, so torch would take the per-tensor loop where a CUDA run takes foreach."""
    import sys

    from torch.optim import optimizer as base

    choose = base._default_to_fused_or_foreach

    def as_on_cuda(params, differentiable, use_fused=False):
        fused, foreach = choose(params, differentiable, use_fused)
        ledger = shim.ledger
        tensors = [p for p in params if p is not None]
        if ledger is not None and tensors and not differentiable and \
                all(shim.placer.on_card(ledger, p) for p in tensors):
            fused = bool(use_fused)
            foreach = not fused
        return fused, foreach

    with contextlib.ExitStack() as scope:
        for name, module in list(sys.modules.items()):
            if (name == "torch.optim" or name.startswith("torch.optim.")) and \
                    getattr(module, "_default_to_fused_or_foreach", None) is choose:
                scope.enter_context(patched(module, "_default_to_fused_or_foreach", as_on_cuda))
        yield
