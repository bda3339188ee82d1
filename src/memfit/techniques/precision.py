"""Precision modes of a training step, as the user's own loop would write them.

``fp32``        weights, gradients, optimizer state and math in float32.
``bf16-mixed``  float32 weights; the forward runs under ``torch.autocast(dtype=bfloat16)``.
``fp16-mixed``  float32 weights; ``torch.autocast(dtype=float16)`` and a dynamic ``GradScaler``.
``bf16``        weights cast to bfloat16, no autocast: gradients and optimizer state in bf16 too.
``fp16``        DeepSpeed's fp16 section (``parallel=zero1-3`` only): the engine casts the weights to float16, keeps
                fp32 master partitions and scales the loss itself. Elsewhere refused: a float16 step without master
                weights or a loss scaler is not one people train with (``fp16-mixed`` is).
"""

from __future__ import annotations

import contextlib

import torch

from memfit.errors import MemfitError
from memfit.techniques.spec import Field, Technique

__all__ = ["PRECISIONS", "check_precision", "autocast", "grad_scaler", "weight_dtype", "check_capability",
           "check_gpu", "TECHNIQUE"]

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16", "fp16")


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise MemfitError(f"unknown precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    return precision


def autocast(precision: str, device_type: str):
    if precision == "bf16-mixed":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    if precision == "fp16-mixed":
        return torch.autocast(device_type, dtype=torch.float16)
    return contextlib.nullcontext()


def check_capability(precision: str, device_type: str) -> None:
    """Refuse a precision the device cannot run, with the reason."""
    if device_type != "cuda" or "bf16" not in precision:
        return
    if not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name()
        major, minor = torch.cuda.get_device_capability()
        raise MemfitError(f"precision={precision} needs bfloat16, which {name} (sm_{major}{minor}) lacks before "
                          "Ampere (sm_80): use fp16-mixed")


def check_gpu(precision: str, gpu) -> None:
    """Refuse a precision a catalog GPU (``memfit.hardware.gpus.GPU``) cannot run: bf16 needs sm_80+."""
    if gpu is not None and "bf16" in precision and not gpu.bf16:
        major, minor = gpu.compute_capability
        raise MemfitError(f"precision={precision} needs bfloat16, which the {gpu.name} (sm_{major}{minor}) lacks "
                          "before Ampere (sm_80): use fp16-mixed, or a bf16 card such as a10g or a100")


def weight_dtype(precision: str):
    """The dtype weights are cast to (``None``: kept as built)."""
    return torch.bfloat16 if precision == "bf16" else None


def grad_scaler(precision: str, device_type: str):
    """A dynamic loss scaler for fp16-mixed; ``None`` otherwise."""
    if precision != "fp16-mixed":
        return None
    return torch.amp.GradScaler(device_type)


def _apply(build) -> None:
    precision, device_type = build.recipe.precision, build.device_type
    check_capability(precision, device_type)
    dtype = weight_dtype(precision)
    if dtype is not None and any(p.is_floating_point() and p.dtype != dtype for p in build.model.parameters()):
        build.model.to(dtype)
    build.forward_contexts.append(lambda: autocast(precision, device_type))
    build.scaler = grad_scaler(precision, device_type)


def _search(ctx):
    bf16 = ctx.gpu is None or ctx.gpu.bf16  # bf16 needs bf16 units (sm80+)
    values = ["fp32", "bf16-mixed" if bf16 else "fp16-mixed"] + (["bf16"] if "bf16" in ctx.allowed and bf16 else [])
    return [{"precision": p} for p in values]


def _conflicts(recipe):
    if recipe.precision == "fp16" and not str(recipe.parallel).startswith("zero"):
        yield ("precision=fp16 is DeepSpeed's fp16 section (parallel=zero1, zero2 or zero3: fp32 master partitions, "
               "its own loss scaling); a training step of your own in half precision is precision=fp16-mixed")


TECHNIQUE = Technique(
    name="precision",
    fields=(Field("precision", "fp32", "default fp32; bf16-mixed halves most activations", slot=10,
                  choices=PRECISIONS),),
    order=10, apply=_apply, search=_search, conflicts=_conflicts,
    approximations=lambda r: ["precision=bf16"] if r.precision == "bf16" else [],
    allow=("bf16",), trace="both")
