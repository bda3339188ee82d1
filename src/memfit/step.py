"""One training step, written once, run on real tensors (measure) or fake ones (estimate).

The loop is the one users write: forward and loss (under autocast when mixed), backward (through
a GradScaler for fp16), optimizer step, ``zero_grad(set_to_none=True)``. Whoever watches (a
``Ledger``) is told the phase and the roles of tensors; with no ledger the loop is plain, which is
how the independent allocator truth in tests and bench/ runs it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Callable

import torch

from memfit.categories import Category
from memfit.errors import MemfitError
from memfit.optim import make_optimizer
from memfit.precision import autocast, grad_scaler

__all__ = ["run_steps", "default_loss", "batch_tensors"]

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


def default_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    """Hugging Face style: ``model(**batch).loss``."""
    if not isinstance(batch, Mapping):
        raise MemfitError(
            "the batch is not a dict, so memfit cannot guess the loss: pass "
            "loss_fn=lambda model, batch: ... returning a scalar loss"
        )
    out = model(**batch)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if loss is None:
        raise MemfitError("the model returned no loss: add labels to the batch or pass loss_fn")
    return loss


def batch_tensors(batch) -> list[torch.Tensor]:
    """Every tensor in a tensor, tuple/list or dict batch."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        return [t for item in batch for t in batch_tensors(item)]
    return []


class _Quiet:
    """Stands in for a ledger when nobody is watching."""

    def begin(self, phase, step):
        pass

    def mark(self, tensor, category):
        pass


def run_steps(model, batch, *, loss_fn: LossFn | None, optimizer, precision: str, steps: int,
              device_type: str, ledger=None) -> torch.optim.Optimizer:
    """Run ``steps`` full optimizer steps of ``model`` on ``batch``; returns the optimizer."""
    watch = ledger or _Quiet()
    loss_fn = loss_fn or default_loss
    opt = make_optimizer(optimizer, model.parameters())
    scaler = grad_scaler(precision, device_type)
    for step in range(steps):
        watch.begin("forward", step)
        saving = _saved_as_activations(watch) if ledger is not None else contextlib.nullcontext()
        with saving, autocast(precision, device_type):
            loss = loss_fn(model, batch)
        _check_loss(loss)
        watch.begin("backward", step)
        (scaler.scale(loss) if scaler else loss).backward()
        for param in model.parameters():
            if param.grad is not None:
                watch.mark(param.grad, Category.GRADIENTS)
        watch.begin("optimizer", step)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    watch.mark(value, Category.OPTIMIZER_STATE)
        opt.zero_grad(set_to_none=True)
        del loss
    return opt


def _check_loss(loss) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise MemfitError(f"loss_fn must return a scalar tensor, got {shape}: reduce it, e.g. .mean()")
    if not loss.requires_grad:
        raise MemfitError("the loss does not require grad: check that the model has trainable parameters in use")


def _saved_as_activations(watch):
    def pack(tensor):
        watch.mark(tensor, Category.ACTIVATIONS)
        return tensor

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
