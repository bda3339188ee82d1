"""How a model placed by a ``device_map`` (``device_map.py``) runs, and which device holds each storage.

**Execution** is Accelerate's dispatch (``dispatch_model``, ``AlignDevicesHook``): a module placed
on a GPU runs there, its inputs moved to it; a module on ``"cpu"`` or ``"disk"`` runs on the main
GPU (the first one in the map), each of its layers' weights copied in before that layer's forward
and dropped after (its buffers live on the main GPU); the model's outputs are moved back to the
device its inputs came from. Those hooks move real tensors between real devices, and a CPU trace
has one device (a CPU build of torch cannot run backward on fake CUDA tensors: ``hardware/cuda.py``),
so the same moves are made here by hand, which is why this module exists: a move is a copy tagged
with its target device (its backward a copy back), and every other new storage takes the device of
the op's first input whose device is known (the i-th output of a foreach op its i-th entry's), as
devices propagate on a GPU; the model's own tensors take their module's device. A copied-in weight
that autograd saves for backward (a frozen layer's weight, to compute its input's gradient) stays on
the GPU until backward has used it: the trace shows what an offloaded training step really holds.

Trainable parameters on ``"cpu"`` or ``"disk"`` are refused: Accelerate's hooks put the weight back
to ``meta`` after each forward, so nothing would ever update them (a forward-only step may keep them there).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from memfit.categories import Category
from memfit.errors import MemfitError
from memfit.techniques.device_map import HOST_SIDES, Placement, label

__all__ = ["Placer", "dispatched"]


class Placer:
    """Gives each storage the ledger records its device (module docstring), and counts the bytes of
    weights copied in from the host."""

    def __init__(self, placement: Placement, root: str, model=None):
        self.placement = placement
        self.root = root
        self.model = model
        self._checked = False
        self._forced: list[str] = []
        self._running: list[str] = []
        self.copied_bytes = 0  # weights copied host -> GPU over the whole trace
        self.copied_from_disk = 0

    def module_device(self, name: str | None) -> str:
        if not name:
            return self.placement.main
        if name == self.root:
            return self.placement.device_of("")
        relative = name[len(self.root) + 1:] if name.startswith(self.root + ".") else name
        return self.placement.device_of(relative)

    def _fallback(self) -> str:
        if self._forced:
            return self._forced[-1]
        return self._running[-1] if self._running else self.placement.main

    def device_of(self, ledger, args, kwargs) -> str:
        """The device an op on these arguments runs on."""
        if self._forced:
            return self._forced[-1]
        for leaf in tree_flatten((args, kwargs))[0]:
            if isinstance(leaf, torch.Tensor):
                record = ledger.record_of(leaf)
                if record is not None and record.device is not None:
                    return _runs_on(record.device, self.placement.main)
        return self._fallback()

    def place(self, ledger, args, kwargs, made, many: bool) -> None:
        """Give each new record of an op its device: the forced one, the i-th entry's of a foreach
        op's first list argument, else the device the op runs on."""
        if self._forced:
            for _, index in made:
                ledger.records[index].device = self._forced[-1]
            return
        common = self.device_of(ledger, args, kwargs)
        lists = [a for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple)) and a
                 and all(isinstance(t, torch.Tensor) for t in a)] if many else []
        for position, index in made:
            device = common
            for entries in lists:
                record = ledger.record_of(entries[position]) if position < len(entries) else None
                if record is not None and record.device is not None:
                    device = _runs_on(record.device, self.placement.main)
                    break
            ledger.records[index].device = device

    def own(self, ledger) -> None:
        """The model's own tensors (made before the step, or by the set-up: LoRA adapters) live with
        their module; buffers of a module on the host live on the main GPU (Accelerate moves them there
        unless ``offload_buffers``); the batch and the rest of the set-up on the main GPU."""
        if not self._checked and self.model is not None:  # after the set-up froze the base, added adapters
            _check_trainable(self.model, self.placement)
            self._checked = True
        for record in ledger.records:
            if record.phase != "setup":
                continue
            device = self.module_device(record.owner) if record.owner else (record.device or self.placement.main)
            if device in HOST_SIDES and record.category is Category.BUFFERS:
                device = self.placement.main
            record.device = device

    @contextlib.contextmanager
    def forced(self, device: str):
        self._forced.append(device)
        try:
            yield
        finally:
            self._forced.pop()


def _runs_on(device: str, main: str) -> str:
    """A tensor on the host that an op reads is first copied to the main GPU by the hooks."""
    return main if device in HOST_SIDES else device


class _Move(torch.autograd.Function):
    """``tensor.to(device)``: a copy on the target device; its backward a copy back."""

    @staticmethod
    def forward(ctx, tensor, placer, source: str, target: str):
        ctx.placer, ctx.source = placer, source
        with placer.forced(target):
            return tensor.clone()

    @staticmethod
    def backward(ctx, grad):
        with ctx.placer.forced(ctx.source):
            return grad.clone(), None, None, None


def _move(placer: Placer, ledger, value, target: str):
    """Every tensor in ``value`` on ``target``, as Accelerate's ``send_to_device``."""

    def one(tensor):
        record = ledger.record_of(tensor)
        source = record.device if record is not None and record.device is not None else placer.placement.main
        source = _runs_on(source, placer.placement.main)
        if source == target:
            return tensor
        if tensor.requires_grad:
            return _Move.apply(tensor, placer, source, target)
        with placer.forced(target):
            return tensor.clone()

    return tree_map_only(torch.Tensor, one, value)


def _device_of_value(ledger, value, default: str) -> str:
    for leaf in tree_flatten(value)[0]:
        if isinstance(leaf, torch.Tensor):
            record = ledger.record_of(leaf)
            if record is not None and record.device is not None:
                return record.device
    return default


@contextlib.contextmanager
def dispatched(model: torch.nn.Module, placement: Placement, ledger, training: bool = True):
    """``model`` run as Accelerate's ``dispatch_model`` runs it (module docstring), with ``ledger``
    told each storage's device. ``training``: refuse trainable parameters off the GPUs."""
    placer = Placer(placement, ledger.root, model if training else None)
    handles = []
    main = placement.main
    for name, device in placement.entries.items():
        module = model.get_submodule(name) if name else model
        target = label(device)
        if target in HOST_SIDES:
            for leaf in module.modules():
                if any(p is not None for p in leaf._parameters.values()):
                    handles += _offload_hooks(leaf, placer, ledger, main, from_disk=target == "disk")
            target = main
        handles.append(module.register_forward_pre_hook(_enter(placer, ledger, target), with_kwargs=True))
        handles.append(module.register_forward_hook(_leave(placer), always_call=True))
    if "" not in placement.entries:  # the top level moves its outputs back where its inputs came from
        handles.append(model.register_forward_pre_hook(_remember(placer, ledger), with_kwargs=True))
        handles.append(model.register_forward_hook(_return(placer, ledger), always_call=True))
    ledger.placer = placer
    try:
        yield placer
    finally:
        ledger.placer = None if ledger.placer is placer else ledger.placer
        for handle in handles:
            handle.remove()


def _check_trainable(model, placement: Placement) -> None:
    for name, param in model.named_parameters():
        if param.requires_grad and placement.device_of(name.rpartition(".")[0]) in HOST_SIDES:
            raise MemfitError(f"device_map puts the trainable parameter {name} on the {placement.device_of(name)}: "
                              "Accelerate's hooks put offloaded weights back after each forward and nothing updates "
                              "them; raise max_memory for the GPUs, add GPUs, or keep trainable "
                              "parameters off the offloaded modules (lora_targets)")


def _enter(placer, ledger, target: str):
    def hook(module, args, kwargs):
        placer._running.append(target)
        return _move(placer, ledger, args, target), _move(placer, ledger, kwargs, target)

    return hook


def _leave(placer):
    def hook(module, args, output):
        if placer._running:
            placer._running.pop()
        return output

    return hook


def _offload_hooks(leaf, placer, ledger, main: str, from_disk: bool):
    """A layer on the host: each weight copied to the main GPU before its forward, the copy dropped
    after (Accelerate's ``AlignDevicesHook(offload=True)`` on every module with parameters of its own)."""
    kept: dict[str, torch.nn.Parameter] = {}

    def before(module, args):
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            kept[name] = param
            with torch.no_grad(), placer.forced(main):
                copy = param.detach().clone()
            ledger.mark(copy, Category.PARAMETERS)  # a weight, on the GPU while its layer needs it
            placer.copied_bytes += param.untyped_storage().nbytes()
            if from_disk:
                placer.copied_from_disk += param.untyped_storage().nbytes()
            module._parameters[name] = torch.nn.Parameter(copy, requires_grad=False)

    def after(module, args, output):
        for name, param in kept.items():
            module._parameters[name] = param
        kept.clear()
        return output

    return [leaf.register_forward_pre_hook(before), leaf.register_forward_hook(after, always_call=True)]


def _remember(placer, ledger):
    def hook(module, args, kwargs):
        placer._inputs_on = _device_of_value(ledger, (args, kwargs), placer.placement.main)
        return None

    return hook


def _return(placer, ledger):
    def hook(module, args, output):
        return _move(placer, ledger, output, _runs_on(getattr(placer, "_inputs_on", placer.placement.main),
                                                         placer.placement.main))

    return hook
