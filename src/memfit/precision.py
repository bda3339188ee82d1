"""Precision modes of a training step, as the user's own loop would write them.

``fp32``        weights, gradients, optimizer state and math in float32.
``bf16-mixed``  float32 weights; the forward runs under ``torch.autocast(dtype=bfloat16)``.
``fp16-mixed``  float32 weights; ``torch.autocast(dtype=float16)`` and a dynamic ``GradScaler``.
``bf16``        weights cast to bfloat16, no autocast: gradients and optimizer state in bf16 too.
"""

from __future__ import annotations

import contextlib

import torch

from memfit.errors import MemfitError

__all__ = ["PRECISIONS", "check_precision", "autocast", "grad_scaler", "cast_model"]

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16")


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


def cast_model(model: torch.nn.Module, precision: str) -> None:
    if precision == "bf16":
        model.to(torch.bfloat16)


class _Scaler(torch.amp.GradScaler):
    """A GradScaler that also steps on fake tensors.

    The stock scaler reads ``found_inf.item()`` to decide whether to skip the step; a fake tensor
    has no value, so under an estimate the step is taken (the memory of a skipped step is a
    subset of a taken one).
    """

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        from torch._subclasses.fake_tensor import FakeTensor

        found = optimizer_state["found_inf_per_device"].values()
        if any(isinstance(value, FakeTensor) for value in found):
            return optimizer.step(*args, **kwargs)
        return super()._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)


def grad_scaler(precision: str, device_type: str):
    """A dynamic loss scaler for fp16-mixed; ``None`` otherwise."""
    if precision != "fp16-mixed":
        return None
    return _Scaler(device_type)
