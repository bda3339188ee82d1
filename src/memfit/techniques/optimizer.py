"""Optimizers by name: the ones a user means when they write ``adamw`` or ``sgd``.

Each name maps to torch's own class with the settings people train with; a callable
``params -> Optimizer`` passes through unchanged, so any optimizer can be estimated. The 8/4-bit
ones come from bitsandbytes (``adamw8bit``, ``paged_adamw8bit``) and torchao (``ao_adamw8bit``,
``adamw4bit``, ``ao_adamw_fp8``; their compiled step on fake tensors: ``_lowbit.py``). ``hf_*``
names are optimizers as Hugging Face's Trainer builds them where that differs from memfit's own
(``hf_sgd`` has no momentum, ``hf_adafactor`` is transformers' Adafactor, ``hf_adamw4bit`` uses
blocks of 256); ``hf_optim`` maps every ``TrainingArguments.optim`` name memfit can model to Recipe
fields, and ``Recipe(optimizer="adamw_torch_fused")`` reads as that mapping.

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

from memfit.errors import MemfitError, shown
from memfit.techniques.spec import Field, Technique

__all__ = ["PAGED_MIN_NUMEL", "page_state", "OPTIMIZERS", "APPROXIMATE", "HF_OPTIM", "hf_optim", "hf_optim_name",
           "EXACT_OPTIMIZERS", "APPROXIMATE_OPTIMIZERS", "make_optimizer", "IMPLEMENTATIONS", "TECHNIQUE"]

OptimizerSpec = str | Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]

#: how torch's optimizer runs its step: ``auto`` is torch's default on the device (the estimate
#: runs what the user's own ``torch.optim.AdamW(params)`` would run), ``foreach`` (one
#: parameter-sized temporary list per step), ``fused`` (one kernel, no step temporaries),
#: ``forloop`` (one parameter at a time: one parameter's temporaries)
IMPLEMENTATIONS = ("auto", "foreach", "fused", "forloop")
NO_FUSED = ("adafactor",)  # torch has no fused Adafactor
ONE_IMPL = ("hf_adafactor",)  # transformers' Adafactor has no foreach or fused step


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
    # as transformers' Trainer builds them for optim="sgd" / "adafactor" (trainer_optimizer.py)
    "hf_sgd": lambda params, kw: torch.optim.SGD(params, lr=1e-3, **kw),
    "hf_adafactor": lambda params, kw: _hf_adafactor(params),
}


def _hf_adafactor(params):
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=1e-3, scale_parameter=False, relative_step=False)


def _bnb(name):
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise MemfitError(f"optimizer {name} needs bitsandbytes: pip install 'memfit[bnb]'") from None
    cls = {"adamw8bit": bnb.optim.AdamW8bit, "paged_adamw8bit": bnb.optim.PagedAdamW8bit}[name]
    return lambda params: cls(params, lr=1e-4)


def _ao(name):
    try:
        import torchao.optim  # noqa: F401
    except ImportError:
        raise MemfitError(f"optimizer {name} needs torchao: pip install 'memfit[ao]'") from None
    from memfit.techniques._lowbit import lowbit_optimizer

    return lambda params: lowbit_optimizer(name, params, lr=1e-4)


# Approximate optimizers: the state is quantized, so the math changes; used only when named.
APPROXIMATE = {"adamw8bit": _bnb, "paged_adamw8bit": _bnb, "ao_adamw8bit": _ao, "adamw4bit": _ao,
               "hf_adamw4bit": _ao, "ao_adamw_fp8": _ao}


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


#: transformers' ``TrainingArguments.optim`` names -> the Recipe fields of the optimizer the Trainer
#: builds for them (transformers 5.x ``trainer_optimizer.py``): ``adamw_torch`` passes neither
#: ``foreach`` nor ``fused`` (torch's default: auto); ``adamw_torch_fused`` is the Trainer's default
#: with torch >= 2.8; ``adamw_torch_4bit`` / ``_8bit`` are torchao's with ``block_size=256``;
#: ``adamw_bnb_8bit`` is bitsandbytes' ``AdamW(optim_bits=8)``, i.e. ``AdamW8bit``; ``sgd`` has no
#: momentum; ``adafactor`` is transformers' own Adafactor (``scale_parameter=False, relative_step=False``)
HF_OPTIM = {
    "adamw_torch": {"optimizer": "adamw", "optimizer_impl": "auto"},
    "adamw_torch_fused": {"optimizer": "adamw", "optimizer_impl": "fused"},
    "adamw_torch_4bit": {"optimizer": "hf_adamw4bit"},
    "adamw_torch_8bit": {"optimizer": "ao_adamw8bit"},
    "adamw_bnb_8bit": {"optimizer": "adamw8bit"},
    "adamw_8bit": {"optimizer": "adamw8bit"},
    "paged_adamw_8bit": {"optimizer": "paged_adamw8bit"},
    "adafactor": {"optimizer": "hf_adafactor"},
    "sgd": {"optimizer": "hf_sgd"},
}


def hf_optim(name: str) -> dict:
    """The Recipe fields (``optimizer``, and ``optimizer_impl`` where the name sets it) of the
    optimizer transformers' Trainer builds for ``TrainingArguments(optim=name)``; a one-line
    ``MemfitError`` for a name memfit cannot model."""
    key = str(getattr(name, "value", name)).lower()  # an OptimizerNames member or its string
    if key in HF_OPTIM:
        return dict(HF_OPTIM[key])
    from transformers.training_args import OptimizerNames

    what = "a transformers optimizer memfit cannot model" if key in {o.value for o in OptimizerNames} else \
        "not a transformers optimizer name"
    raise MemfitError(f"optim={shown(name, 40)} is {what}: use one of {', '.join(HF_OPTIM)}, or pass your "
                      "optimizer as a callable params -> Optimizer")


def hf_optim_name(optimizer: str, optimizer_impl: str = "auto") -> str | None:
    """The Trainer's ``optim`` name that builds memfit's ``optimizer`` / ``optimizer_impl`` (the inverse of
    ``hf_optim``); None where transformers has none."""
    for name, fields in HF_OPTIM.items():
        if fields["optimizer"] == optimizer and fields.get("optimizer_impl", "auto") == optimizer_impl:
            return name
    return None


def _normalize(values: dict) -> dict:
    """``optimizer`` given as a transformers name (``adamw_torch_fused``) -> memfit's fields."""
    name = values.get("optimizer")
    if not isinstance(name, str) or name in OPTIMIZERS or name in APPROXIMATE or name not in HF_OPTIM:
        return values
    mapped = hf_optim(name)
    impl = values.get("optimizer_impl", "auto")
    if "optimizer_impl" in mapped:
        if impl not in ("auto", mapped["optimizer_impl"]):
            raise MemfitError(f"optimizer={name} and optimizer_impl={impl} conflict: {name} is "
                              f"optimizer_impl={mapped['optimizer_impl']}; drop one")
        if impl != "auto":
            mapped.pop("optimizer_impl")
    return {**values, **mapped}


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
    if impl == "auto" and getattr(build.recipe, "offload", "none") != "none":
        impl = "forloop"  # FSDP2's CPU offload steps on host tensors: torch's default there is the for-loop

    def make(params):
        opt = make_optimizer(spec, params, impl)
        page_state(opt, watch)
        return opt

    build.make_optimizer = make


def _conflicts(r):
    if r.optimizer_impl != "auto" and r.optimizer in ONE_IMPL:
        yield (f"optimizer_impl={r.optimizer_impl} and optimizer={r.optimizer} conflict: transformers' Adafactor "
               "has one implementation; drop optimizer_impl")
    if r.optimizer_impl == "fused" and r.optimizer in NO_FUSED:
        yield f"optimizer_impl=fused and optimizer={r.optimizer} conflict: torch has no fused {r.optimizer}; use foreach"
    if r.optimizer_impl != "auto" and r.optimizer in APPROXIMATE_OPTIMIZERS:
        yield (f"optimizer_impl={r.optimizer_impl} and optimizer={r.optimizer} conflict: the 8/4-bit optimizers "
               "have one implementation; drop optimizer_impl")
    if r.optimizer_impl != "auto" and r.offload_optimizer:
        yield (f"optimizer_impl={r.optimizer_impl} and offload_optimizer conflict: the CPU step is torchao's; "
               "drop optimizer_impl")


#: torch's optimizers with a fused step, on the CPU and on CUDA alike (torch >= 2.4)
FUSED = ("adamw", "adam", "sgd", "hf_sgd")


def _search(ctx):
    """The user's optimizer (and the 8-bit ones ``allow`` names), each as torch's default step and,
    where torch has one, fused: the same update within rounding (``tests/test_optimizer_impl.py``),
    no parameter-sized step temporaries, fewer bytes moved, so the cost model finds it faster."""
    names = [ctx.optimizer] + [o for o in SEARCH_APPROXIMATE if o in ctx.allowed and o != ctx.optimizer]
    out = []
    for o in names:
        out.append({"optimizer": o})
        if o in FUSED:
            out.append({"optimizer": o, "optimizer_impl": "fused"})
    return out


TECHNIQUE = Technique(
    name="optimizer",
    fields=(Field("optimizer", "adamw", f"one of {', '.join(EXACT_OPTIMIZERS + APPROXIMATE_OPTIMIZERS)} "
                  "(default adamw; 8/4-bit change the math), or a transformers optim name (adamw_torch_fused, ...)", slot=60,
                  choices=EXACT_OPTIMIZERS + APPROXIMATE_OPTIMIZERS, flag_choices=False),
            Field("optimizer_impl", "auto", "auto (torch's default on the device) | foreach | fused (no step "
                  "temporaries) | forloop", slot=65, choices=IMPLEMENTATIONS)),
    order=60, apply=_apply, search=_search, trace="optimizer", conflicts=_conflicts, normalize=_normalize,
    approximations=lambda r: [f"optimizer={r.optimizer}"] if r.optimizer in APPROXIMATE_OPTIMIZERS else [],
    allow=SEARCH_APPROXIMATE)
