"""A memfit recipe in Hugging Face's Trainer: ``TrainingArguments`` from a recipe, and a callback that
reports the measured peak beside the predicted one.

``training_arguments(recipe, output_dir=...)`` sets what the Trainer can express of a recipe:
per-device batch and accumulation, gradient checkpointing (non-reentrant, as memfit's), bf16/fp16
autocast, ``optim`` (the inverse of ``optimizer.hf_optim``) and ``torch_compile``. A field the
Trainer has no argument for (LoRA, chunked loss, activation offload, optimizer in backward, pure
bf16 weights, selective checkpointing, ...) is one error naming it: apply it to the model yourself
(``memfit.apply``) or train with ``memfit train``. Nothing is dropped silently.

``MemfitCallback(predicted_bytes)`` measures each optimizer step's peak and logs
``memfit/peak_bytes``, ``memfit/predicted_bytes`` and their ratio with the Trainer's own logs. On
CUDA the peak is ``torch.cuda.max_memory_allocated`` (reset at each step's start); on the CPU a
``VirtualBudget`` counts the step's tensors above what is resident at its start (the model, its
gradients and the optimizer's state), which is what ``estimate`` reports as ``peak_bytes``.

Why by hand: transformers has no memory-budget arguments; the mapping is memfit's vocabulary.
"""

from __future__ import annotations

import torch

from memfit.errors import MemfitError
from memfit.techniques.optimizer import HF_OPTIM, hf_optim_name
from memfit.techniques.recipe import Recipe
from memfit.accounting.budget import VirtualBudget

__all__ = ["training_arguments", "MemfitCallback", "trainer_fields"]

# Recipe fields the Trainer sets (the rest must be at their defaults)
_HANDLED = {"precision", "checkpointing", "optimizer", "optimizer_impl", "micro_batch_size", "grad_accum_steps",
            "compile", "set_to_none", "attention"}


def _optim(recipe: Recipe) -> str:
    name = hf_optim_name(recipe.optimizer, recipe.optimizer_impl)
    if name is None:
        raise MemfitError(f"optimizer={recipe.optimizer} (optimizer_impl={recipe.optimizer_impl}) has no Trainer optim "
                          f"name: use one of {', '.join(HF_OPTIM)}'s optimizers, or pass optimizers= to the Trainer")
    return name


def trainer_fields(recipe: Recipe) -> dict:
    """The ``TrainingArguments`` keywords for ``recipe`` (see the module docstring)."""
    default = Recipe()
    other = [name for name in Recipe.fields() if name not in _HANDLED
             and getattr(recipe, name) != getattr(default, name)]
    if other:
        shown = ", ".join(f"{n}={getattr(recipe, n)}" for n in other)
        raise MemfitError(f"the Trainer has no argument for {shown}: apply it to the model with memfit.apply, "
                          "or train with memfit train")
    if recipe.precision == "bf16":
        raise MemfitError("precision=bf16 (bf16 weights) is the model's dtype, not a Trainer argument: load the "
                          "model in bf16 and use precision=bf16-mixed's autocast off, or use memfit train")
    if recipe.checkpointing not in ("off", "blocks"):
        raise MemfitError(f"checkpointing={recipe.checkpointing}: the Trainer checkpoints every block or none; use "
                          "blocks or off")
    if not recipe.set_to_none:
        raise MemfitError("set_to_none=False: the Trainer always frees gradients after a step; drop it")
    if recipe.attention != "auto":
        raise MemfitError(f"attention={recipe.attention} is the model's attn_implementation: pass it when you "
                          "build the model")
    fields = {"per_device_train_batch_size": recipe.micro_batch_size or 1,
              "gradient_accumulation_steps": recipe.grad_accum_steps,
              "bf16": recipe.precision == "bf16-mixed", "fp16": recipe.precision == "fp16-mixed",
              "optim": _optim(recipe)}
    if recipe.checkpointing == "blocks":
        fields["gradient_checkpointing"] = True
        fields["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    if getattr(recipe, "compile", False):
        fields["torch_compile"] = True
    return fields


def training_arguments(recipe: Recipe, *, output_dir: str, **overrides):
    """``transformers.TrainingArguments`` carrying ``recipe``; ``overrides`` are passed through (and
    may not contradict the recipe)."""
    from transformers import TrainingArguments

    fields = trainer_fields(recipe)
    clash = [k for k in overrides if k in fields and overrides[k] != fields[k]]
    if clash:
        raise MemfitError(f"{clash[0]}={overrides[clash[0]]!r} contradicts the recipe's {fields[clash[0]]!r}: change "
                          "the recipe instead")
    return TrainingArguments(output_dir=output_dir, **{**fields, **overrides})


def _resident(model, optimizer) -> int:
    storages = {}
    tensors = list(model.parameters()) + list(model.buffers()) + \
        [p.grad for p in model.parameters() if p.grad is not None]
    if optimizer is not None:
        tensors += [v for state in getattr(optimizer, "state", {}).values() for v in state.values()
                    if isinstance(v, torch.Tensor)]
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr(), storage.nbytes()] = storage.nbytes()
    return sum(storages.values())


def _callback_base():
    from transformers import TrainerCallback

    return TrainerCallback


class MemfitCallback(_callback_base()):
    """Logs each step's measured peak against ``predicted_bytes`` (memfit's ``peak_bytes``)."""

    def __init__(self, predicted_bytes: int | None = None):
        self.predicted = predicted_bytes
        self.peaks: list[int] = []
        self._budget = None

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if torch.cuda.is_available() and not args.use_cpu:
            torch.cuda.reset_peak_memory_stats()
            return
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the optimizer
        self._budget = VirtualBudget(resident=_resident(model, inner))
        self._budget.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self._budget is not None:
            self._budget.__exit__(None, None, None)
            peak, self._budget = self._budget.peak, None
        else:
            peak = torch.cuda.max_memory_allocated()
        self.peaks.append(peak)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or not self.peaks:
            return
        ours = {"memfit/peak_bytes": self.peaks[-1]}
        if self.predicted:
            ours["memfit/predicted_bytes"] = self.predicted
            ours["memfit/measured_over_predicted"] = round(self.peaks[-1] / self.predicted, 4)
        logs.update(ours)  # what reporters (TensorBoard, ...) are handed
        if state.log_history:  # the Trainer kept its own copy of logs before calling back
            state.log_history[-1].update(ours)
