"""Attention implementation: memory-efficient kernels instead of a materialised S x S matrix.

Memory: eager attention keeps ``batch x heads x seq x seq`` scores and probabilities (and a dropout
mask) for backward; SDPA's flash / memory-efficient kernels keep only the output and a logsumexp.
Cost: none, usually faster. On CPU, SDPA with dropout falls back to the math path, which does
materialise the matrix; the estimate shows it.

Hugging Face models switch with ``set_attn_implementation``; ``nn.MultiheadAttention`` takes its
fused path only with ``need_weights=False``, which ``sdpa`` forces.

Does not combine with: nothing in ``Recipe``.
"""

from __future__ import annotations

import functools

import torch

from memfit.errors import MemfitError
from memfit.techniques.spec import Field, Technique

__all__ = ["set_attention", "ATTENTION", "TECHNIQUE"]

ATTENTION = ("auto", "sdpa", "eager")


def set_attention(model: torch.nn.Module, mode: str) -> None:
    if mode == "auto":
        return
    if hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation(mode)
        except (ValueError, ImportError) as err:
            raise MemfitError(f"attention={mode} is not available for this model: {str(err).splitlines()[0]}") from None
    elif getattr(model, "config", None) is not None and hasattr(model.config, "_attn_implementation"):
        model.config._attn_implementation = mode
    if mode == "sdpa":
        for module in model.modules():
            if isinstance(module, torch.nn.MultiheadAttention):
                _no_weights(module)


def _no_weights(module: torch.nn.MultiheadAttention) -> None:
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        kwargs["need_weights"] = False
        return inner(*args, **kwargs)

    module.forward = forward


TECHNIQUE = Technique(
    name="attention",
    fields=(Field("attention", "auto", "auto (as built) | sdpa | eager", slot=40, choices=ATTENTION),),
    order=25, apply=lambda build: set_attention(build.model, build.recipe.attention), trace="graph")
