"""Optimizers by name: the ones a user means when they write ``adamw`` or ``sgd``.

Each name maps to torch's own class with the settings people train with; a callable
``params -> Optimizer`` passes through unchanged, so any optimizer can be estimated.

Paged optimizers (bitsandbytes' ``paged_adamw8bit``, or any bnb optimizer with ``is_paged``) keep
the state of each parameter of at least ``PAGED_MIN_NUMEL`` elements in CUDA managed memory
(``F.get_paged``: ``cudaMallocManaged``), outside torch's caching allocator, so it never shows in
``max_memory_allocated`` / ``max_memory_reserved`` and the driver pages it to the host under
pressure. Traced with CUDA semantics on the CPU, bnb takes its CPU path (plain tensors, a warning);
``page_state`` then tells the ledger which buffers a GPU would have made managed.
"""

from __future__ import annotations

import warnings
from typing import Callable, Iterable

import torch

from memfit.errors import MemfitError
from memfit.techniques.spec import Field, Technique

__all__ = ["PAGED_MIN_NUMEL", "page_state", "OPTIMIZERS", "APPROXIMATE", "EXACT_OPTIMIZERS", "APPROXIMATE_OPTIMIZERS", "make_optimizer", "IMPLEMENTATIONS", "TECHNIQUE"]

OptimizerSpec = str | Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]

#: how torch's optimizer runs its step: ``auto`` is torch's default on the device (the estimate
#: runs what the user's own ``torch.optim.AdamW(params)`` would run), ``foreach`` (one
#: parameter-sized temporary list per step), ``fused`` (one kernel, no step temporaries),
#: ``forloop`` (one parameter at a time: one parameter's temporaries)
IMPLEMENTATIONS = ("auto", "foreach", "fused", "forloop")
NO_FUSED = ("adafactor",)  # torch has no fused Adafactor


def _impl(impl: str) -> dict:
    """The keyword arguments of ``impl``. ``auto`` traced with CUDA semantics is CUDA's default
    (foreach), which fake CPU tensors would not pick by themselves."""
    if impl == "auto":
        from memfit.hardware.cuda import active

        return {"foreach": True} if active() else {}
    return {"foreach": {"foreach": True}, "fused": {"fused": True}, "forloop": {"foreach": False}}[impl]


OPTIMIZERS: dict[str, Callable] = {
    "adamw": lambda params, kw: torch.optim.AdamW(params, lr=1e-4, **kw),
    "adam": lambda params, kw: torch.optim.Adam(params, lr=1e-4, **kw),
    "sgd": lambda params, kw: torch.optim.SGD(params, lr=1e-3, momentum=0.9, **kw),
    "adafactor": lambda params, kw: torch.optim.Adafactor(params, lr=1e-2, **kw),
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


def make_optimizer(spec: OptimizerSpec, params, impl: str = "auto") -> torch.optim.Optimizer:
    """Build the optimizer named by ``spec`` over ``params`` (trainable parameters only), its step
    run as ``impl`` (one of ``IMPLEMENTATIONS``; torch's optimizers only)."""
    params = [p for p in params if p.requires_grad]
    if not params:
        raise MemfitError("the model has no trainable parameters: unfreeze some or pass a different model")
    if callable(spec):
        if impl != "auto":
            raise MemfitError(f"optimizer_impl={impl} and a custom optimizer conflict: set foreach/fused on your "
                              "optimizer, or drop optimizer_impl")
        return spec(params)
    name = str(spec).lower()
    if name in OPTIMIZERS:
        return OPTIMIZERS[name](params, _impl(impl))
    if name not in APPROXIMATE:
        names = ", ".join([*OPTIMIZERS, *APPROXIMATE])
        raise MemfitError(f"unknown optimizer {spec!r}: choose one of {names}, or pass a callable params -> Optimizer")
    return APPROXIMATE[name](name)(params)


EXACT_OPTIMIZERS = tuple(OPTIMIZERS)
APPROXIMATE_OPTIMIZERS = tuple(APPROXIMATE)
#: the 8-bit forms the planner may switch to when ``allow`` names them
SEARCH_APPROXIMATE = ("adamw8bit", "paged_adamw8bit")


#: bitsandbytes ``Optimizer8bit.get_state_buffer`` (0.50): on a GPU, a paged optimizer's state
#: buffer is ``F.get_paged`` (managed memory) unless ``p.numel() < 1e5``; then, and for the
#: ``absmax`` / ``qmap`` tensors of 8-bit state, a plain ``torch.zeros`` on the device.
#: ``tests/test_managed.py`` runs bnb's own method to check this.
PAGED_MIN_NUMEL = 100_000


def page_state(opt, watch) -> None:
    """Under CUDA semantics (``hardware.cuda.active()``), mark the state buffers of a paged bnb
    optimizer that a GPU would allocate as managed memory: ``watch.manage(buffers)`` with all the
    managed buffers of one parameter (bnb prefetches them together before its update)."""
    from memfit.hardware.cuda import active

    manage = getattr(watch, "manage", None)
    if not getattr(opt, "is_paged", False) or manage is None or not active():
        return
    plain, buffers = opt.get_state_buffer, {}

    def get_state_buffer(p, dtype=torch.float32):
        with warnings.catch_warnings():  # bnb's "not supported on CPU": the trace's CPU, not the GPU's step
            warnings.filterwarnings("ignore", "Paged optimizers are not supported on CPU")
            buff = plain(p, dtype=dtype)
        if p.numel() >= PAGED_MIN_NUMEL:
            buffers.setdefault(id(p), []).append(buff)
            manage(buffers[id(p)])
        return buff

    opt.get_state_buffer = get_state_buffer


def _apply(build) -> None:
    spec, impl, watch = build.optimizer_spec, build.recipe.optimizer_impl, build.watch

    def make(params):
        opt = make_optimizer(spec, params, impl)
        page_state(opt, watch)
        return opt

    build.make_optimizer = make


def _conflicts(r):
    if r.optimizer_impl == "fused" and r.optimizer in NO_FUSED:
        yield f"optimizer_impl=fused and optimizer={r.optimizer} conflict: torch has no fused {r.optimizer}; use foreach"
    if r.optimizer_impl != "auto" and r.optimizer in APPROXIMATE_OPTIMIZERS:
        yield (f"optimizer_impl={r.optimizer_impl} and optimizer={r.optimizer} conflict: the 8/4-bit optimizers "
               "have one implementation; drop optimizer_impl")
    if r.optimizer_impl != "auto" and r.offload_optimizer:
        yield (f"optimizer_impl={r.optimizer_impl} and offload_optimizer conflict: the CPU step is torchao's; "
               "drop optimizer_impl")


def _search(ctx):
    names = [ctx.optimizer] + [o for o in SEARCH_APPROXIMATE if o in ctx.allowed and o != ctx.optimizer]
    return [{"optimizer": o} for o in names]


TECHNIQUE = Technique(
    name="optimizer",
    fields=(Field("optimizer", "adamw", f"one of {', '.join(EXACT_OPTIMIZERS + APPROXIMATE_OPTIMIZERS)} "
                  "(default adamw; 8/4-bit change the math)", slot=60,
                  choices=EXACT_OPTIMIZERS + APPROXIMATE_OPTIMIZERS, flag_choices=False),
            Field("optimizer_impl", "auto", "auto (torch's default on the device) | foreach | fused (no step "
                  "temporaries) | forloop", slot=65, choices=IMPLEMENTATIONS)),
    order=60, apply=_apply, search=_search, trace="optimizer", conflicts=_conflicts,
    approximations=lambda r: [f"optimizer={r.optimizer}"] if r.optimizer in APPROXIMATE_OPTIMIZERS else [],
    allow=SEARCH_APPROXIMATE)
