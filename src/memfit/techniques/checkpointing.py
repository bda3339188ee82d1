"""Activation checkpointing: keep a block's inputs, recompute its insides in backward.

Memory: a checkpointed block holds only its inputs between forward and backward; its saved
activations exist again one block at a time during backward. Cost: one more forward of every
checkpointed block (about a third more compute for a transformer). Selective checkpointing keeps
matmul and attention outputs (expensive to recompute) and recomputes pointwise ops (cheap).

Built on ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` and
``create_selective_checkpoint_contexts``. Blocks are found automatically: the classes a Hugging
Face model names in ``_no_split_modules``, else the children of the longest ``ModuleList`` whose
children share one class.

Does not combine with: nothing in ``Recipe``; with ``offload_activations`` only what is saved
outside checkpointed blocks moves (block inputs are held by the checkpoint itself).
"""

from __future__ import annotations

import copy
import functools
import re

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memfit.errors import MemfitError, shown
from memfit.techniques.spec import Field, Technique

__all__ = ["find_blocks", "apply_checkpointing", "no_kv_cache", "checkpoint_plan", "EVERY", "TECHNIQUE"]

#: every N-th block checkpointed: the values of N the planner tries (where N < depth)
EVERY = (2, 3, 4, 6, 8, 16)

_aten = torch.ops.aten
# Outputs worth keeping: producing them costs FLOPs, not just memory traffic.
_SAVE = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten.convolution.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_cudnn_attention.default,
}


def find_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The repeated blocks of ``model`` as (path, module), in order."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        found = [(n, m) for n, m in model.named_modules() if type(m).__name__ in names]
        if found:
            return found
    best: list = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) >= 2:
            kinds = {type(child) for child in module}
            if len(kinds) == 1 and len(module) > len(best):
                best = [(f"{name}.{i}" if name else str(i), child) for i, child in enumerate(module)]
    return best


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


class _Checkpointed:
    """A block's forward run under ``torch.utils.checkpoint``. An object rather than a closure: a deep copy of the
    model (the estimator's ``fake_copy`` of a model a script checkpointed in place with ``memfit.apply``) gets its
    own, bound to the copy's block; a closure is copied as itself and ran the original's real weights."""

    def __init__(self, inner, selective: bool):
        functools.update_wrapper(self, inner)
        # what runs inside the checkpoint: compile="layers" puts the compiled block here, inside the
        # checkpoint, as torchtune's checkpoint wrapper around a compiled layer runs it
        self.checkpointed = inner
        self.context_fn = functools.partial(create_selective_checkpoint_contexts, _policy) if selective else None

    def __call__(self, *args, **kwargs):
        run = self.checkpointed
        if not torch.is_grad_enabled():
            return run(*args, **kwargs)
        extra = {"context_fn": self.context_fn} if self.context_fn else {}
        return checkpoint(run, *args, use_reentrant=False, **extra, **kwargs)


def _wrap(module: torch.nn.Module, selective: bool) -> None:
    module.forward = _Checkpointed(module.forward, selective)


def apply_checkpointing(model: torch.nn.Module, *, mode: str, every: object = 1) -> list[str]:
    """Checkpoint ``model`` in place; returns the paths of the checkpointed modules.

    mode   "blocks" (every ``every``-th block), "selective" (every block, op-level policy) or
           "modules" (``every`` is then the tuple of module paths).
    """
    if mode == "off":
        return []
    if mode == "modules":
        table = dict(model.named_modules())
        missing = [name for name in every if name not in table]
        if missing:
            raise MemfitError(f"checkpointing names modules the model does not have: {', '.join(missing)}")
        chosen = [(name, table[name]) for name in every]
    else:
        blocks = find_blocks(model)
        if not blocks:
            raise MemfitError("checkpointing found no repeated blocks in the model: "
                              "use checkpointing=modules:name1,name2")
        chosen = blocks[:: every] if mode == "blocks" else blocks
    for _, module in chosen:
        _wrap(module, selective=mode == "selective")
    no_kv_cache(model)
    return [name for name, _ in chosen]


def no_kv_cache(model: torch.nn.Module) -> None:
    """A KV cache filled in forward is filled again by the recomputation (keys twice as long);
    Hugging Face's own ``gradient_checkpointing_enable`` turns it off for the same reason. The
    config is copied first: it is often shared with other models built from it."""
    config = getattr(model, "config", None)
    if not getattr(config, "use_cache", False):
        return
    private = copy.deepcopy(config)
    private.use_cache = False
    for module in model.modules():
        if getattr(module, "config", None) is config:
            module.config = private


def checkpoint_plan(value) -> tuple[str, object]:
    """("off" | "blocks" | "selective" | "modules", every-N or module names) of a ``checkpointing`` value."""
    if value in ("off", "blocks", "selective"):
        return value, 1
    kind, _, rest = value.partition(":") if isinstance(value, str) else ("", "", "")
    if kind == "blocks" and re.fullmatch(r"[0-9]{1,9}", rest) and int(rest) >= 1:
        return "blocks", int(rest)
    names = tuple(name.strip() for name in rest.split(",") if name.strip())
    if kind == "modules" and names:
        return "modules", names
    raise MemfitError(f"checkpointing {shown(value)} not understood: use off, blocks, blocks:2, selective "
                      "or modules:name1,name2")


def _apply(build) -> None:
    mode, every = checkpoint_plan(build.recipe.checkpointing)
    apply_checkpointing(build.model, mode=mode, every=every)


def _search(ctx):
    if not ctx.has_blocks:
        return [{"checkpointing": "off"}]
    levels = ["off", "selective", "blocks"] + [f"blocks:{n}" for n in EVERY if n < ctx.depth]
    return [{"checkpointing": level} for level in levels]


TECHNIQUE = Technique(
    name="checkpointing",
    fields=(Field("checkpointing", "off", "off | blocks | blocks:N | selective | modules:a,b (recompute in backward)",
                  slot=20, check=checkpoint_plan),),
    order=30, apply=_apply, search=_search, trace="graph")
