"""Optimizers by name: the ones a user means when they write ``adamw`` or ``sgd``.

Each name maps to torch's own class with the settings people train with; a callable
``params -> Optimizer`` passes through unchanged, so any optimizer can be estimated.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from memfit.errors import MemfitError

__all__ = ["OPTIMIZERS", "make_optimizer"]

OptimizerSpec = str | Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]

# NOTE: foreach/fused are left to torch's defaults so the estimate runs what the user's own
# ``torch.optim.AdamW(params)`` would run on the same device.
OPTIMIZERS: dict[str, Callable] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-4),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-4),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
    "adafactor": lambda params: torch.optim.Adafactor(params, lr=1e-2),
}


def make_optimizer(spec: OptimizerSpec, params) -> torch.optim.Optimizer:
    """Build the optimizer named by ``spec`` over ``params`` (trainable parameters only)."""
    params = [p for p in params if p.requires_grad]
    if not params:
        raise MemfitError("the model has no trainable parameters: unfreeze some or pass a different model")
    if callable(spec):
        return spec(params)
    factory = OPTIMIZERS.get(str(spec).lower())
    if factory is None:
        names = ", ".join(OPTIMIZERS)
        raise MemfitError(f"unknown optimizer {spec!r}: choose one of {names}, or pass a callable params -> Optimizer")
    return factory(params)
