"""``apply``: turn a model and a ``Recipe`` into (model, optimizer, step).

The one place techniques are composed, always in this order, so that each sees the model the
previous one left:

1. precision       weights cast for pure bf16; autocast / GradScaler chosen for the step
1b. lora           peft adapters on the (cast) base, base frozen; qlora quantises the base first
2. attention       the model's attention implementation
3. checkpointing   blocks (or named modules) wrapped in ``torch.utils.checkpoint``
4. loss            ``chunked_loss`` replaces the loss function
5. optimizer       built by name; stepped in backward or offloaded if asked
6. step            micro-batches with normalised losses, activation offload hooks around forward

``estimate``, ``measure`` and (later) training all get their step from here, so what is
estimated is what runs.
"""

from __future__ import annotations

import torch

from memfit.categories import Category
from memfit.errors import MemfitError
from memfit.techniques.optimizer import make_optimizer
from memfit.techniques.precision import autocast, check_capability, grad_scaler, weight_dtype
from memfit.techniques.recipe import Recipe
from memfit.techniques.step import check_loss, default_loss, split_batch, token_weights
from memfit.techniques.attention import set_attention
from memfit.techniques.checkpointing import apply_checkpointing
from memfit.techniques.lora import apply_lora, quantize_base
from memfit.techniques.chunked_loss import chunked_lm_loss
from memfit.techniques.offload import ActivationOffload
from memfit.techniques.optim_backward import InBackward

__all__ = ["apply", "run_steps"]


class _Quiet:
    """Stands in for a ledger when nobody is watching."""

    def begin(self, phase, step):
        pass

    def mark(self, tensor, category):
        pass


def apply(model: torch.nn.Module, recipe: Recipe | None = None, *, optimizer=None, loss_fn=None, watch=None):
    """Apply ``recipe`` to ``model`` (in place); returns ``(model, optimizer, step)``.

    optimizer  ``None`` (the recipe's), or a callable ``params -> Optimizer`` to use instead.
    loss_fn    ``loss_fn(model, batch) -> scalar``; default ``model(**batch).loss``.
    step       ``step(batch) -> loss``: one optimizer step over ``recipe.grad_accum_steps``
               micro-batches of ``batch`` (split along dim 0), gradients zeroed after.
    """
    recipe = recipe or Recipe()
    watch = watch or _Quiet()
    device_type = next((p.device.type for p in model.parameters()), "cpu")
    check_capability(recipe.precision, device_type)
    _cast(model, recipe.precision)
    kind, rank = recipe.lora_plan()
    if kind == "qlora":
        quantize_base(model)  # once: a model already quantised (see ``trace``) is left as it is
    if kind in ("lora", "qlora"):
        model = apply_lora(model, rank=rank)
    for param in model.parameters():  # adapters are parameters too, not temporaries
        watch.mark(param, Category.PARAMETERS)
    set_attention(model, recipe.attention)
    mode, every = recipe.checkpoint_plan()
    apply_checkpointing(model, mode=mode, every=every)
    if recipe.chunked_loss:
        if loss_fn is not None:
            raise MemfitError("chunked_loss and loss_fn conflict: chunked_loss computes the loss itself; "
                              "drop loss_fn or set chunked_loss=0")
        loss_fn = chunked_lm_loss(recipe.chunked_loss)
    opt = _optimizer(model, recipe, optimizer, device_type)
    step = _Step(model, recipe, opt, loss_fn or default_loss, watch, device_type)
    return model, opt, step


def _cast(model, precision: str) -> None:
    dtype = weight_dtype(precision)
    if dtype is not None and any(p.is_floating_point() and p.dtype != dtype for p in model.parameters()):
        model.to(dtype)


def _optimizer(model, recipe: Recipe, factory, device_type: str):
    spec = factory or recipe.optimizer
    if recipe.offload_optimizer:
        if device_type != "cuda":
            raise MemfitError("offload_optimizer needs a CUDA device: on the CPU the optimizer state is "
                              "already in host memory; set offload_optimizer=false")
        from memfit.techniques.optimizer import offloaded

        return offloaded(spec, model.parameters())
    if recipe.optimizer_in_backward:
        return InBackward(model.parameters(), lambda params: make_optimizer(spec, params))
    return make_optimizer(spec, model.parameters())


class _Step:
    """One optimizer step of a recipe; see ``apply``."""

    def __init__(self, model, recipe: Recipe, opt, loss_fn, watch, device_type: str):
        self.model, self.recipe, self.opt, self.loss_fn = model, recipe, opt, loss_fn
        self.watch, self.device_type = watch, device_type
        self.scaler = grad_scaler(recipe.precision, device_type)
        self.offload = ActivationOffload() if recipe.offload_activations else None
        self.count = 0
        self.skipped = 0  # fp16-mixed steps the GradScaler skipped (inf/nan gradients)

    def _hooks(self):
        offload, watch = self.offload, self.watch

        def pack(tensor):
            watch.mark(tensor, Category.ACTIVATIONS)
            if not offload:
                return tensor
            packed = offload.pack(tensor)
            note = getattr(watch, "note_offload", None)
            if packed is not tensor and note is not None:  # bytes over the host link: the planner's cost
                note(tensor)
            return packed

        def unpack(packed):
            return offload.unpack(packed) if offload else packed

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def __call__(self, batch):
        index, self.count = self.count, self.count + 1
        micro = split_batch(batch, self.recipe.grad_accum_steps, self.recipe.micro_batch_size)
        weights = token_weights(self.model, micro) if len(micro) > 1 else [None]
        total = None
        for part, weight in zip(micro, weights):
            self.watch.begin("forward", index)
            with self._hooks(), autocast(self.recipe.precision, self.device_type):
                loss = self.loss_fn(self.model, part)
            check_loss(loss)
            if weight is not None:
                loss = loss * weight
            self.watch.begin("backward", index)
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
        for param in self.model.parameters():
            if param.grad is not None:
                self.watch.mark(param.grad, Category.GRADIENTS)
        self.watch.begin("optimizer", index)
        if self.scaler:
            before = self.scaler.get_scale()
            self.scaler.step(self.opt)
            self.scaler.update()
            self.skipped += self.scaler.get_scale() < before  # the scale backs off only on a skip
        else:
            self.opt.step()
        for state in getattr(self.opt, "state", {}).values():  # torchao's CPU offload keeps none here
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self.watch.mark(value, Category.OPTIMIZER_STATE)
        self.opt.zero_grad(set_to_none=True)
        return total


def run_steps(model, batch, *, recipe: Recipe, steps: int, optimizer=None, loss_fn=None, watch=None):
    """``apply`` then ``steps`` optimizer steps; the loop estimate, measure and the truth share."""
    _, opt, step = apply(model, recipe, optimizer=optimizer, loss_fn=loss_fn, watch=watch)
    for _ in range(steps):
        step(batch)
    if isinstance(opt, InBackward):
        opt.remove()
    return opt

