"""LoRA through peft: the base weights freeze, small low-rank adapters train.

Memory: gradients and optimizer state exist only for the adapters (a few MiB instead of 12 bytes
per base parameter with AdamW); activations are about the same (the frozen layers still save
their inputs for the adapters' backward). Cost: slightly more compute per linear layer; the model
learns a low-rank update only, so the result differs from full fine-tuning: ``Recipe.is_exact``
is False and the planner uses it only when allowed by name.

Adapters go on every linear layer but the output head (peft's ``all-linear`` for Hugging Face
models; every ``nn.Linear`` but the last otherwise), rank ``r``, alpha ``2r``, no dropout.

On fake tensors peft's move of each new adapter to its base layer's device would swap a fake
parameter in place, which torch refuses; the adapters are built where the base already is, so the
move is skipped while wrapping.

Does not combine with: QLoRA (4-bit base through bitsandbytes) is not built yet.
"""

from __future__ import annotations

import contextlib

import torch

from memfit.errors import MemfitError

__all__ = ["apply_lora"]


@contextlib.contextmanager
def _no_moves(model):
    from torch._subclasses.fake_tensor import FakeTensor

    if not any(isinstance(p, FakeTensor) for p in model.parameters()):
        yield
        return
    original = torch.nn.Module.to
    torch.nn.Module.to = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.nn.Module.to = original


def _targets(model) -> list[str] | str:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover
        PreTrainedModel = ()
    if isinstance(model, PreTrainedModel):
        return "all-linear"
    names = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    return names[:-1] or names


def apply_lora(model: torch.nn.Module, *, rank: int) -> torch.nn.Module:
    """``model`` wrapped by peft with LoRA adapters of rank ``rank``; the base is frozen."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise MemfitError("lora needs peft: pip install 'memfit[peft]'") from None
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=_targets(model))
    with _no_moves(model):
        return get_peft_model(model, config)
