"""Activation offload: saved activations leave device memory until backward needs them.

Memory: activations no longer pile up on the device during forward; each comes back for its
backward op and is freed after. Cost: two copies of every activation over the host link (on CUDA
overlapped on a side stream into pinned buffers; here on CPU a plain copy).

On a CUDA device the store is pinned host memory. On the CPU the "device" is the CPU allocator
itself, so the store is NumPy memory, which the allocator (and its profiler) do not see; this is
what lets the effect be measured and tested without a GPU. On fake tensors nothing is copied: the
store keeps the layout and the unpacked tensor is a fresh fake one, allocating what the real
unpack allocates.

What stays on the device, since moving it saves nothing: small tensors (< ``MIN_BYTES``), and any
tensor whose storage is a parameter's or buffer's of the model, frozen or not, viewed, transposed or
expanded (a frozen layer saves its weight transposed; a chunked head on a frozen tied weight saves it
expanded to (batch, rows, vocab), 1.47 GiB on Llama-3.2-3B: offloaded, each came back as a new
device copy while the weight itself never left), and any other expanded view (stride 0): its copy
would hold the expansion. Nothing is copied on the device to offload a strided view: the CUDA copy
reads it as it is into pinned memory, the CPU store is NumPy's copy of it.
Written by hand because ``torch.autograd.graph.save_on_cpu`` on a CPU device *adds* memory
(unpinned copies in the same allocator; +18% measured) and has no fake-tensor path.

Does not combine with: nothing in ``Recipe``; with checkpointing only tensors saved outside
checkpointed regions move.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from memfit.techniques.spec import Field, Technique

__all__ = ["ActivationOffload", "MIN_BYTES", "TECHNIQUE"]

MIN_BYTES = 1024


class ActivationOffload:
    """A (pack, unpack) pair for ``torch.autograd.graph.saved_tensors_hooks``; ``model``'s parameters
    and buffers, and views of them, stay where they are."""

    def __init__(self, model: torch.nn.Module | None = None):
        tensors = [*model.parameters(), *model.buffers()] if model is not None else []
        self.resident = {StorageWeakRef(t.untyped_storage()) for t in tensors}

    def stays(self, tensor: torch.Tensor) -> bool:
        """Whether offloading ``tensor`` would save nothing (see the module docstring)."""
        root = tensor._base if tensor._base is not None else tensor  # a parameter's view, wherever it moved since
        return (tensor.untyped_storage().nbytes() < MIN_BYTES or isinstance(root, torch.nn.Parameter)
                or (tensor.requires_grad and tensor.is_leaf)
                or any(step == 0 and size > 1 for step, size in zip(tensor.stride(), tensor.shape))
                or StorageWeakRef(tensor.untyped_storage()) in self.resident)

    def pack(self, tensor: torch.Tensor):
        if self.stays(tensor):
            return tensor
        from torch._subclasses.fake_tensor import FakeTensor

        layout = (tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device)
        if isinstance(tensor, FakeTensor):
            return ("fake", layout, None)  # backward runs inside the same fake mode
        if tensor.device.type == "cuda":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            return ("host", layout, host)
        data = tensor.detach()
        as_bits = data.view(_BITS[data.element_size()]) if data.dtype in _NO_NUMPY else data
        return ("numpy", layout, as_bits.numpy().copy())  # NumPy's copy, contiguous, outside the allocator

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        kind, (shape, stride, dtype, device), store = packed
        out = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        if kind == "fake":
            return out
        if kind == "host":
            out.copy_(store, non_blocking=True)
        else:
            source = torch.from_numpy(store)
            out.copy_(source.view(dtype) if dtype in _NO_NUMPY else source.view(shape))
        return out


_NO_NUMPY = {torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2}
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _apply(build) -> None:
    if not build.recipe.offload_activations:
        return
    offload, watch = ActivationOffload(build.model), build.watch

    def pack(tensor):
        packed = offload.pack(tensor)
        note = getattr(watch, "note_offload", None)
        if packed is not tensor and note is not None:  # bytes over the host link: the planner's cost
            note(tensor)
        return packed

    build.pack.append((pack, offload.unpack))


TECHNIQUE = Technique(
    name="offload_activations",
    fields=(Field("offload_activations", False, "keep saved activations in host memory", slot=30, kind="bool"),),
    order=35, apply=_apply, trace="graph",
    # on a GPU only (on the CPU there is no host to offload to); with selective checkpointing
    # little is saved outside the recomputed ops, so the pair is not searched
    # on a Mac the host is the same unified memory: offloading to it saves nothing
    search=lambda ctx: [{"offload_activations": v} for v in
                        ((False, True) if ctx.gpu is not None and getattr(ctx.gpu, "vendor", "") != "apple"
                         else (False,))],
    searchable=lambda r: not (r.offload_activations and r.checkpointing == "selective"))
