"""Optimizers by name: the ones a user means when they write ``adamw`` or ``sgd``.

Each name maps to torch's own class with the settings people train with; a callable
``params -> Optimizer`` passes through unchanged, so any optimizer can be estimated.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from memfit.errors import MemfitError
from memfit.techniques.spec import Field, Technique

__all__ = ["OPTIMIZERS", "APPROXIMATE", "EXACT_OPTIMIZERS", "APPROXIMATE_OPTIMIZERS", "make_optimizer", "TECHNIQUE"]

OptimizerSpec = str | Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]

# NOTE: foreach/fused are left to torch's defaults so the estimate runs what the user's own
# ``torch.optim.AdamW(params)`` would run on the same device. Traced with CUDA semantics, the
# default is CUDA's (foreach), which fake CPU tensors would not pick by themselves.
def _foreach() -> dict:
    from memfit.hardware.cuda import active

    return {"foreach": True} if active() else {}


OPTIMIZERS: dict[str, Callable] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-4, **_foreach()),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-4, **_foreach()),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9, **_foreach()),
    "adafactor": lambda params: torch.optim.Adafactor(params, lr=1e-2, **_foreach()),
}


def _bnb(name):
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise MemfitError(f"optimizer {name} needs bitsandbytes: pip install 'memfit[bnb]'") from None
    cls = {"adamw8bit": bnb.optim.AdamW8bit, "paged_adamw8bit": bnb.optim.PagedAdamW8bit}[name]
    return lambda params: cls(params, lr=1e-4)


def _ao(name):
    try:
        from torchao.optim import AdamW4bit
    except ImportError:
        raise MemfitError(f"optimizer {name} needs torchao: pip install 'memfit[ao]'") from None
    return lambda params: AdamW4bit(params, lr=1e-4)


# Approximate optimizers: the state is quantized, so the math changes; used only when named.
APPROXIMATE = {"adamw8bit": _bnb, "paged_adamw8bit": _bnb, "adamw4bit": _ao}


def make_optimizer(spec: OptimizerSpec, params) -> torch.optim.Optimizer:
    """Build the optimizer named by ``spec`` over ``params`` (trainable parameters only)."""
    params = [p for p in params if p.requires_grad]
    if not params:
        raise MemfitError("the model has no trainable parameters: unfreeze some or pass a different model")
    if callable(spec):
        return spec(params)
    name = str(spec).lower()
    factory = OPTIMIZERS.get(name) or (APPROXIMATE[name](name) if name in APPROXIMATE else None)
    if factory is None:
        names = ", ".join([*OPTIMIZERS, *APPROXIMATE])
        raise MemfitError(f"unknown optimizer {spec!r}: choose one of {names}, or pass a callable params -> Optimizer")
    return factory(params)


EXACT_OPTIMIZERS = tuple(OPTIMIZERS)
APPROXIMATE_OPTIMIZERS = tuple(APPROXIMATE)
#: the 8-bit forms the planner may switch to when ``allow`` names them
SEARCH_APPROXIMATE = ("adamw8bit", "paged_adamw8bit")


def _apply(build) -> None:
    spec = build.optimizer_spec
    build.make_optimizer = lambda params: make_optimizer(spec, params)


def _search(ctx):
    names = [ctx.optimizer] + [o for o in SEARCH_APPROXIMATE if o in ctx.allowed and o != ctx.optimizer]
    return [{"optimizer": o} for o in names]


TECHNIQUE = Technique(
    name="optimizer",
    fields=(Field("optimizer", "adamw", f"one of {', '.join(EXACT_OPTIMIZERS + APPROXIMATE_OPTIMIZERS)} "
                  "(default adamw; 8/4-bit change the math)", slot=60,
                  choices=EXACT_OPTIMIZERS + APPROXIMATE_OPTIMIZERS, flag_choices=False),),
    order=60, apply=_apply, search=_search, trace="optimizer",
    approximations=lambda r: [f"optimizer={r.optimizer}"] if r.optimizer in APPROXIMATE_OPTIMIZERS else [],
    allow=SEARCH_APPROXIMATE)
