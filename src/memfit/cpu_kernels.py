"""Fake kernels for CPU ops whose meta kernel follows CUDA's rules instead of the CPU's.

``aten._grouped_mm`` (the kernel behind ``torch.nn.functional.grouped_mm``, which Hugging Face's
default ``experts_implementation="grouped_mm"`` calls for every mixture-of-experts layer) has a
meta kernel that copies the CUDA checks: it refuses anything but bfloat16 ("Expected inputs of
BF16 type"). The CPU kernel of torch 2.13 runs in any float dtype, so on fake CPU tensors an fp32
or bf16-mixed Mixtral step failed although the real CPU step runs. Its output is a plain
contiguous ``torch.empty`` of the product's shape on a CPU build (the meta kernel pads strides only
``if torch.version.cuda``), which is what ``CpuKernels`` makes for non-bf16 operands; bf16 goes
to the meta kernel unchanged. ``tests/test_families.py`` checks a Mixtral and a Qwen2-MoE step
against the CPU allocator in fp32, bf16-mixed and bf16.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CpuKernels"]

_GROUPED_MM = torch.ops.aten._grouped_mm.default


def _grouped_mm_shape(a: torch.Tensor, b: torch.Tensor, offs) -> list[int]:
    """Output shape of ``_grouped_mm`` (``_create_grouped_mm_output_tensor`` in torch's metas)."""
    if a.dim() == 2 and b.dim() == 2:
        return [offs.size(0), a.size(0), b.size(1)]
    if a.dim() == 2:
        return [a.size(0), b.size(-1)]
    if b.dim() == 2:
        return [a.size(1), b.size(1)]
    return [a.size(0), a.size(1), b.size(-1)]


class CpuKernels(TorchDispatchMode):
    """Answers ops whose meta kernel rejects what the CPU kernel accepts (see module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _GROUPED_MM:
            a, b = args[0], args[1]
            offs = args[2] if len(args) > 2 else kwargs.get("offs")
            out_dtype = (args[4] if len(args) > 4 else kwargs.get("out_dtype")) or a.dtype
            if a.device.type == "cpu" and a.dtype != torch.bfloat16:
                if a.dtype != b.dtype:
                    raise RuntimeError(f"grouped_mm needs operands of one dtype, got {a.dtype} and {b.dtype}")
                return torch.empty(_grouped_mm_shape(a, b, offs), dtype=out_dtype, device=a.device)
        return func(*args, **kwargs)
