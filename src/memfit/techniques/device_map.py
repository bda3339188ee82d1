"""``device_map`` placement: where Accelerate puts each module, and what each GPU and the host hold
while the step runs so placed.

**Placement** is transformers' own: ``from_pretrained(device_map="auto", max_memory=...)`` calls
``transformers.integrations.accelerate._get_device_map`` (balanced budgets over the GPUs, the
quantiser's 10 % margin, Accelerate's ``infer_auto_device_map`` over the model's
``_no_split_modules``), and that function runs here on the fake model, whose sizes it reads from
shapes and dtypes (a QLoRA base is already 4-bit, so its weights count half a byte each). A model
that is not a transformers one is placed by Accelerate's ``infer_auto_device_map`` itself. A dict
given by the user is taken as it is (its names checked against the model).

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
to ``meta`` after each forward, so nothing would ever update them. 4-bit weights off the GPUs are
refused as transformers refuses them (``llm_int8_enable_fp32_cpu_offload`` keeps them fp32: not
modelled).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from memfit.categories import Category
from memfit.errors import MemfitError, shown
from memfit.scoped import patched
from memfit.units import format_size, parse_size

__all__ = ["Placement", "Placer", "STRATEGIES", "parse_max_memory", "check_device_map", "place", "dispatched",
           "HOST_SIDES"]

# the strings from_pretrained takes for device_map (transformers' _get_device_map)
STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
HOST_SIDES = ("cpu", "disk")


@dataclass(frozen=True)
class Placement:
    """A device map over ``gpus`` GPUs: module name -> GPU index, "cpu" or "disk"."""

    entries: dict
    gpus: int
    max_memory: dict = field(default_factory=dict)
    strategy: str = "custom"

    @property
    def main(self) -> str:
        """The GPU that runs the modules on the host (Accelerate's ``main_device``)."""
        indices = sorted(v for v in self.entries.values() if isinstance(v, int))
        return str(indices[0]) if indices else "0"

    @property
    def single(self) -> bool:
        """Everything on one GPU."""
        return len({_label(v) for v in self.entries.values()}) == 1 and self.main == _label(
            next(iter(self.entries.values())))

    @property
    def devices(self) -> list[str]:
        """Every device the map uses, GPUs first: "0", "1", ..., "cpu", "disk"."""
        used = {_label(v) for v in self.entries.values()} | {self.main}
        return sorted(used - set(HOST_SIDES), key=int) + [d for d in HOST_SIDES if d in used]

    def device_of(self, name: str) -> str:
        """Where the module called ``name`` (relative to the model) lives: the longest entry that is it
        or contains it."""
        best, found = -1, self.main
        for key, value in self.entries.items():
            if (key == "" or name == key or name.startswith(key + ".")) and len(key) > best:
                best, found = len(key), _label(value)
        return found

    def to_dict(self) -> dict:
        return {"strategy": self.strategy, "gpus": self.gpus, "entries": dict(self.entries),
                "max_memory": {str(k): v for k, v in self.max_memory.items()}}


def _label(value) -> str:
    return str(value)


def parse_max_memory(value) -> dict:
    """``{0: bytes, 1: bytes, "cpu": bytes}`` from ``"0=70GB,1=70GB,cpu=100GB"`` or a dict like
    from_pretrained's ``max_memory``; one error naming the fix otherwise."""
    if value is None:
        return {}
    if isinstance(value, str):
        pairs = []
        for part in filter(None, (p.strip() for p in value.split(","))):
            key, sep, size = part.partition("=")
            if not sep:
                raise MemfitError(f"max_memory entry {part!r} has no '=': write it as 0=70GB,1=70GB,cpu=100GB")
            pairs.append((key.strip(), size.strip()))
    elif isinstance(value, dict):
        pairs = list(value.items())
    else:
        raise MemfitError(f"max_memory must be a dict or a string like 0=70GB,cpu=100GB, got {shown(value)}")
    out = {}
    for key, size in pairs:
        if isinstance(key, str) and key.isdigit():
            key = int(key)
        if not (key in HOST_SIDES or (isinstance(key, int) and not isinstance(key, bool) and 0 <= key < MAX_GPUS)):
            raise MemfitError(f"max_memory key {key!r} is not a device: use GPU indices (0, 1, ...), cpu or disk")
        try:
            out[key] = parse_size(size)
        except MemfitError:
            raise MemfitError(f"max_memory[{key}]={size!r} is not a size: write it like 70GB or 80GiB") from None
    return out


MAX_GPUS = 1024


def check_device_map(value):
    """A device_map as from_pretrained takes it: a strategy name, a dict, or a path to a .json of one."""
    if isinstance(value, str) and value in STRATEGIES:
        return value
    if isinstance(value, str) and value.endswith(".json"):
        if not os.path.isfile(value):
            raise MemfitError(f"device_map file {value} does not exist: pass auto, or a .json of module -> device")
        with open(value) as handle:
            try:
                value = json.load(handle)
            except json.JSONDecodeError as err:
                raise MemfitError(f"device_map file is not JSON ({err.msg}, line {err.lineno}): fix it") from None
    if not isinstance(value, dict) or not value:
        raise MemfitError(f"device_map must be one of {', '.join(STRATEGIES)}, a dict of module -> device or a "
                          f".json of one, got {shown(value)}")
    out = {}
    for key, device in value.items():
        if isinstance(device, str) and device.isdigit():
            device = int(device)
        if isinstance(device, str) and device.startswith("cuda:") and device[5:].isdigit():
            device = int(device[5:])
        if not (device in HOST_SIDES or (isinstance(device, int) and not isinstance(device, bool) and device >= 0)):
            raise MemfitError(f"device_map[{key!r}]={device!r} is not a device: use a GPU index, cpu or disk")
        out[str(key)] = device
    return out


class _QuantizerRules:
    """What transformers' bitsandbytes 4-bit quantiser does to placement, for a base already quantised
    (its weights' real sizes are on the model): 10 % of each budget kept for quantisation buffers
    (``adjust_max_memory``), and no 4-bit weight off the GPUs (``validate_environment``)."""

    def adjust_max_memory(self, max_memory):
        return {key: value * 0.90 for key, value in max_memory.items()}

    def param_element_size(self, model, name, param):
        return param.element_size()

    def validate_environment(self, device_map=None, **_):
        off = [name for name, device in (device_map or {}).items() if device in HOST_SIDES]
        if off:
            raise MemfitError(f"qlora and device_map conflict: {len(off)} module(s) land on the host ({off[0]}, ...) "
                              "and transformers refuses 4-bit weights off the GPUs: raise max_memory for the GPUs, "
                              "add GPUs, or use lora")


def place(model: torch.nn.Module, device_map, max_memory, *, gpus: int, card, qlora: bool,
          offload_folder: str | None = None) -> Placement:
    """The ``Placement`` from_pretrained would make of ``model`` (module docstring). ``gpus`` GPUs of
    ``card`` (a catalog GPU) when ``max_memory`` names none: each its memory less the CUDA context;
    the host unbounded unless ``max_memory`` says."""
    device_map = check_device_map(device_map)
    budgets = parse_max_memory(max_memory)
    named = sorted(k for k in budgets if isinstance(k, int))
    mapped = [d for d in device_map.values() if isinstance(d, int)] if isinstance(device_map, dict) else []
    count = max(named) + 1 if named else (gpus or max(mapped, default=0) + 1)
    if named and gpus and gpus != count:
        raise MemfitError(f"gpus={gpus} and max_memory naming GPUs {named} conflict: drop gpus, or name GPUs "
                          f"0 to {gpus - 1}")
    if not named:  # from_pretrained reads each GPU's free memory, and keeps 10 % of a lone GPU's back
        for index in range(count):
            budgets[index] = int((card.memory_bytes - card.cuda_context_bytes) * (0.9 if count == 1 else 1))
    budgets.setdefault("cpu", HOST_UNBOUNDED)
    if isinstance(device_map, dict):
        _check_names(model, device_map)
        entries = device_map
        if qlora:
            _QuantizerRules().validate_environment(device_map=entries)
        strategy = "custom"
    else:
        entries = _infer(model, device_map, budgets, qlora)
        strategy = device_map
    bad = [d for d in entries.values() if isinstance(d, int) and d >= count]
    if bad:
        raise MemfitError(f"device_map puts modules on GPU {bad[0]} of {count}: pass gpus={bad[0] + 1} or fix the map")
    if "disk" in entries.values() and offload_folder is None:
        disk = [name for name, device in entries.items() if device == "disk"]
        raise MemfitError(f"device_map puts {len(disk)} module(s) on disk ({disk[0]}, ...) and no offload folder is "
                          "given: pass offload_folder (--offload-folder DIR), or raise max_memory for cpu")
    return Placement(entries=dict(entries), gpus=count, max_memory=budgets, strategy=strategy)


HOST_UNBOUNDED = 1 << 50  # "cpu" left out of max_memory: as much host RAM as the map needs


def _check_names(model, device_map: dict) -> None:
    names = {n for n, _ in model.named_modules()} | {n for n, _ in model.named_parameters()}
    for key in device_map:
        if key and key not in names:
            raise MemfitError(f"device_map names {key!r}, which is no module of {type(model).__name__}: use names "
                              "from model.named_modules() (e.g. model.layers.0)")


def _infer(model, strategy: str, budgets: dict, qlora: bool) -> dict:
    """transformers' (or for another model Accelerate's) automatic map of ``model`` under ``budgets``."""
    budgets = {k: v for k, v in budgets.items() if v is not None}
    with _gpus_visible(sum(isinstance(k, int) for k in budgets)):
        if hasattr(model, "_no_split_modules") and hasattr(model, "all_tied_weights_keys"):
            from transformers.integrations.accelerate import _get_device_map

            rules = _QuantizerRules() if qlora else None
            entries = _get_device_map(model, strategy, dict(budgets), rules)
        else:
            from accelerate import infer_auto_device_map
            from accelerate.utils import get_balanced_memory

            if strategy != "sequential":
                budgets = get_balanced_memory(model, max_memory=dict(budgets), low_zero=strategy == "balanced_low_0")
            entries = infer_auto_device_map(model, max_memory=budgets)
    entries = dict(entries)
    if set(entries.values()) <= {"disk"} or not any(isinstance(v, int) for v in entries.values()):
        gpu_budget = ", ".join(f"GPU {k}: {format_size(v)}" for k, v in budgets.items() if isinstance(k, int))
        raise MemfitError(f"device_map={strategy} puts nothing on a GPU ({gpu_budget}): the largest block does not "
                          "fit; raise max_memory for the GPUs or add GPUs")
    return entries


@contextlib.contextmanager
def _gpus_visible(count: int):
    """Accelerate checks the GPUs named in max_memory against ``torch.cuda.device_count()``; on a
    machine without them it warns and transformers' balancing reads their free memory. The fake
    model is placed on ``count`` GPUs that exist only in the budget."""
    import logging

    log = logging.getLogger("accelerate.utils.modeling")
    before = log.disabled
    log.disabled = True
    try:
        with patched(torch.cuda, "device_count", lambda: count):
            yield
    finally:
        log.disabled = before


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

    @contextlib.contextmanager
    def running(self, device: str):
        self._running.append(device)
        try:
            yield
        finally:
            self._running.pop()


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
        target = _label(device)
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
