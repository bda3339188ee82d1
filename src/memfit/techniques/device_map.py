"""``device_map`` placement: where Accelerate puts each module, and what each GPU and the host hold
while the step runs so placed.

**Placement** is transformers' own: ``from_pretrained(device_map="auto", max_memory=...)`` calls
``transformers.integrations.accelerate._get_device_map`` (balanced budgets over the GPUs, the
quantiser's 10 % margin, Accelerate's ``infer_auto_device_map`` over the model's
``_no_split_modules``), and that function runs here on the fake model, whose sizes it reads from
shapes and dtypes (a QLoRA base is already 4-bit, so its weights count half a byte each). A model
that is not a transformers one is placed by Accelerate's ``infer_auto_device_map`` itself. A dict
given by the user is taken as it is (its names checked against the model).

How the placed step runs, and what each device then holds: ``dispatch.py``. 4-bit weights off the
GPUs are refused as transformers refuses them (``llm_int8_enable_fp32_cpu_offload`` keeps them fp32:
not modelled).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field

import torch

from memfit.errors import MemfitError, shown
from memfit.scoped import patched
from memfit.units import format_size, parse_size

__all__ = ["Placement", "STRATEGIES", "parse_max_memory", "check_device_map", "place", "HOST_SIDES", "label"]

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
        return len({label(v) for v in self.entries.values()}) == 1 and self.main == label(
            next(iter(self.entries.values())))

    @property
    def devices(self) -> list[str]:
        """Every device the map uses, GPUs first: "0", "1", ..., "cpu", "disk"."""
        used = {label(v) for v in self.entries.values()} | {self.main}
        return sorted(used - set(HOST_SIDES), key=int) + [d for d in HOST_SIDES if d in used]

    def device_of(self, name: str) -> str:
        """Where the module called ``name`` (relative to the model) lives: the longest entry that is it
        or contains it."""
        best, found = -1, self.main
        for key, value in self.entries.items():
            if (key == "" or name == key or name.startswith(key + ".")) and len(key) > best:
                best, found = len(key), label(value)
        return found

    def to_dict(self) -> dict:
        return {"strategy": self.strategy, "gpus": self.gpus, "entries": dict(self.entries),
                "max_memory": {str(k): v for k, v in self.max_memory.items()}}


def label(value) -> str:
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
