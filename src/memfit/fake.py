"""Models and batches made of fake tensors: shapes, dtypes and devices, no memory.

A model built by a factory is built on the meta device (no memory, no initialisation cost) and
its parameters and buffers are then turned into fake tensors of the target device; building
directly inside ``FakeTensorMode`` breaks modules that deep-copy themselves
(``nn.TransformerEncoder``: "Mixing fake modes NYI"). A ready module is deep-copied with every
parameter and buffer swapped for a fake twin, so the user's model is never touched.
"""

from __future__ import annotations

import copy

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

__all__ = ["fake_copy", "build_fake", "fake_batch"]


def _fake_param(mode: FakeTensorMode, tensor: torch.Tensor, device: torch.device, cache: dict):
    key = id(tensor)
    if key not in cache:
        if tensor.device.type == "meta":
            fake = mode.fake_tensor_converter.from_meta_and_device(mode, tensor.detach(), device)
        else:
            fake = mode.from_tensor(tensor.detach())
        if isinstance(tensor, torch.nn.Parameter):
            fake = torch.nn.Parameter(fake, requires_grad=tensor.requires_grad)
        cache[key] = fake
    return cache[key]


def fake_copy(module: torch.nn.Module, mode: FakeTensorMode) -> torch.nn.Module:
    """A deep copy of ``module`` whose parameters and buffers are fake (ties kept)."""
    cache: dict = {}
    memo: dict = {}
    for tensor in list(module.parameters()) + list(module.buffers()):
        memo[id(tensor)] = _fake_param(mode, tensor, tensor.device, cache)
    return copy.deepcopy(module, memo)


def build_fake(build, mode: FakeTensorMode, device: torch.device) -> torch.nn.Module:
    """Call ``build()`` on the meta device, then make its tensors fake tensors on ``device``."""
    with torch.device("meta"):
        module = build()
    cache: dict = {}
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None:
                sub._parameters[name] = _fake_param(mode, param, device, cache)
        for name, buf in list(sub._buffers.items()):
            if buf is not None:
                sub._buffers[name] = _fake_param(mode, buf, device, cache)
        for name, value in list(vars(sub).items()):
            if isinstance(value, torch.Tensor) and value.device.type == "meta":
                setattr(sub, name, _fake_param(mode, value, device, cache))
    return module


def fake_batch(batch, mode: FakeTensorMode):
    """Real tensors in ``batch`` become fake ones; a callable is called inside the mode."""
    if callable(batch):
        with mode:
            return batch()
    return tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, batch)
