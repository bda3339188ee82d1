"""``apply``: turn a model and a ``Recipe`` into (model, optimizer, step).

The one place techniques are composed. Each registered technique (``registry.py``) runs its
``apply`` in its declared order on a ``Build`` (``spec.py``), so each sees the model the previous
one left; the built-in order is:

10 precision              weights cast for pure bf16; autocast / GradScaler chosen for the step
15 lora                   peft adapters on the (cast) base, base frozen; qlora quantises the base first
25 attention              the model's attention implementation
30 checkpointing          blocks (or named modules) wrapped in ``torch.utils.checkpoint``
35 offload_activations    saved activations packed off the device around forward
40 chunked_loss           replaces the loss function
60 optimizer              built by name (or the caller's factory)
62 offload_optimizer      ... with state and step on the CPU
63 accumulation           the batch split into micro-batches
64 optimizer_in_backward  ... stepped in backward instead
66 zero_grad              gradients freed after the step, or zeroed in place

Then the parameters are labelled, the optimizer is built and the step is made: micro-batches with
normalised losses, each forward inside the techniques' contexts and saved-tensor hooks.

``estimate``, ``measure`` and (later) training all get their step from here, so what is
estimated is what runs.
"""

from __future__ import annotations

import contextlib

import torch

from memfit.categories import Category
from memfit.errors import MemfitError, shown
from memfit.techniques.optimizer import make_optimizer
from memfit.techniques.optimizer_in_backward import InBackward
from memfit.techniques.recipe import Recipe
from memfit.techniques.registry import techniques
from memfit.techniques.spec import Build
from memfit.techniques.step import check_loss, default_loss, token_weights

__all__ = ["apply", "run_steps", "Quiet", "inner_tensors"]


class Quiet:
    """Stands in for a ledger when nobody is watching."""

    def begin(self, phase, step):
        pass

    def mark(self, tensor, category):
        pass

    def manage(self, tensors):
        pass

    def settle(self):
        pass


def apply(model: torch.nn.Module, recipe: Recipe | None = None, *, optimizer=None, loss_fn=None, watch=None):
    """Apply ``recipe`` to ``model`` (in place); returns ``(model, optimizer, step)``.

    optimizer  ``None`` (the recipe's), or a callable ``params -> Optimizer`` to use instead.
    loss_fn    ``loss_fn(model, batch) -> scalar``; default ``model(**batch).loss``.
    step       ``step(batch) -> loss``: one optimizer step over ``recipe.grad_accum_steps``
               micro-batches of ``batch`` (split along dim 0), gradients zeroed after.
    """
    _check_apply(model, recipe, optimizer, loss_fn)
    recipe = recipe or Recipe()
    if callable(optimizer):
        optimizer = _checked_factory(optimizer)
    build = Build(recipe, model, next((p.device.type for p in model.parameters()), "cpu"), watch or Quiet(),
                  loss_fn=loss_fn, user_loss=loss_fn is not None, optimizer_spec=optimizer or recipe.optimizer)
    for technique in techniques():
        if technique.apply is not None:
            technique.apply(build)
    for param in build.model.parameters():  # adapters are parameters too, not temporaries
        build.watch.mark(param, Category.PARAMETERS)
    make = build.make_optimizer or (lambda params: make_optimizer(build.optimizer_spec, params))
    opt = make(build.model.parameters())
    return build.model, opt, _Step(build, opt)


def _check_apply(model, recipe, optimizer, loss_fn) -> None:
    """``apply``'s arguments, each wrong type one line naming the fix (not an AttributeError deep inside)."""
    if not isinstance(model, torch.nn.Module):
        raise MemfitError(f"apply takes a torch.nn.Module as its model, got {_kind(model)}: build the model first "
                          "(memfit.estimate takes names, configs and factories)")
    if recipe is not None and not isinstance(recipe, Recipe):
        raise MemfitError(f"recipe must be a memfit.Recipe, got {_kind(recipe)}: use Recipe(precision='bf16-mixed', "
                          "...) or Recipe.load(path)")
    if optimizer is not None and not callable(optimizer) and not isinstance(optimizer, str):
        raise MemfitError(f"optimizer must be a name ('adamw') or a callable params -> torch.optim.Optimizer, got "
                          f"{_kind(optimizer)}")
    if loss_fn is not None and not callable(loss_fn):
        raise MemfitError(f"loss_fn must be a callable loss_fn(model, batch) -> scalar tensor, got {_kind(loss_fn)}")


def _kind(value) -> str:
    return f"{type(value).__name__} {shown(value, 40)}" if value is not None else "None"


def _checked_factory(factory):
    """The caller's ``params -> Optimizer``, its result checked: something without ``step`` and
    ``zero_grad`` would fail only at the first step, as an AttributeError."""
    def make(params):
        opt = factory(params)
        if not all(callable(getattr(opt, name, None)) for name in ("step", "zero_grad")):
            raise MemfitError(f"the optimizer factory {shown(getattr(factory, '__qualname__', factory), 40)} returned "
                              f"{_kind(opt)}: it must return a torch.optim.Optimizer, e.g. "
                              "lambda params: torch.optim.AdamW(params)")
        return opt

    make.__wrapped__ = factory
    return make


class _Step:
    """One optimizer step of a recipe; see ``apply``."""

    def __init__(self, build: Build, opt):
        self.model, self.recipe, self.opt = build.model, build.recipe, opt
        self.loss_fn, self.watch, self.device_type = build.loss_fn or default_loss, build.watch, build.device_type
        self.scaler = build.scaler
        self.contexts, self.pack = list(build.forward_contexts), list(build.pack)
        self.split = build.split or (lambda batch: [batch])
        self.set_to_none = build.set_to_none
        self.before_micro = list(build.before_micro)
        self.step_contexts = list(build.step_contexts)
        self.micro_contexts = list(build.micro_contexts)
        self.batch_contexts = list(build.batch_contexts)
        self.pipeline = build.pipeline
        self.stepper = build.wrap_step(opt) if build.wrap_step is not None else None  # safe_step's SafeStep
        self.engine = build.engine  # DeepSpeed's (deepspeed.py): the forward goes through it, and the backward
        self.count = 0
        self.skipped = 0  # fp16-mixed steps the GradScaler skipped (inf/nan gradients)

    def _hooks(self):
        pairs, watch = self.pack, self.watch

        def pack(tensor):
            watch.mark(tensor, Category.ACTIVATIONS)
            packed = tensor
            for pack_one, _ in pairs:
                packed = pack_one(packed)
            # Kept as itself, a saved output would hold its own grad_fn: a cycle through C++ that no
            # gc sees, so a branch backward never reaches (LLaVA's unused last vision layer) or a
            # forward that raises would never be freed. Without hooks torch saves outputs without
            # their grad_fn; a detached alias (same storage, no new memory) does the same.
            return tensor.detach() if packed is tensor and tensor.grad_fn is not None else packed

        def unpack(packed):
            for _, unpack_one in reversed(pairs):
                packed = unpack_one(packed)
            return packed

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _forward(self, part):
        # No hooks when nothing packs and nobody watches: an identity pack hook keeps a saved output
        # and its grad_fn in a cycle torch's gc cannot see, so a forward that raises (an OOM) would
        # leak its partial graph; backward breaks the cycle, an exception does not.
        hooks = self._hooks() if self.pack or not isinstance(self.watch, Quiet) else contextlib.nullcontext()
        with hooks, contextlib.ExitStack() as stack:
            for context in self.contexts:
                stack.enter_context(context())
            return self.loss_fn(self.model if self.engine is None else self.engine, part)

    def __call__(self, batch):
        """One optimizer step over ``batch``, split as the recipe says."""
        with contextlib.ExitStack() as stack:
            for context in self.step_contexts:
                stack.enter_context(context())
            total = self.backward(self.split(batch))
            self.update()
        return total

    def infer(self, batch):
        """The forward alone, without gradients (``torch.no_grad``, the model in eval mode: no dropout),
        over the whole ``batch``, with the recipe's forward contexts (autocast); returns its output."""
        index = self.count
        was_training = self.model.training
        self.model.eval()
        try:
            with contextlib.ExitStack() as stack:
                for context in self.step_contexts + self.micro_contexts:
                    stack.enter_context(context())
                self.watch.begin("forward", index)
                with torch.no_grad():
                    out = self._forward(batch)
        finally:
            self.model.train(was_training)
        self.count += 1
        return out

    def backward(self, micro: list, *, weights: list | None = None, around=None):
        """Forward and backward of each micro-batch of ``micro`` (one global batch), losses weighted
        so the accumulated gradients are the whole batch's; returns the batch's loss. The optimizer
        has not stepped: ``update`` does that (a trainer may redo this after an out-of-memory error).

        weights  each micro-batch's loss weight (default: its share of the batch's label tokens)
        around   ``around(number, last)``: a context manager around each micro-batch (a data-parallel
                 trainer's gradient sync and agreement, ``training/lockstep.py``)"""
        index = self.count
        if self.pipeline is not None:  # the stage's schedule runs every micro-batch (pipeline_parallel.py)
            self.watch.begin("forward", index)
            with contextlib.ExitStack() as stack:
                for context in self.micro_contexts:  # loss parallel, around the schedule's losses and backwards
                    stack.enter_context(context())
                total = self.pipeline(micro, self.watch, index)
            self._mark_gradients()
            return total
        if weights is None:
            weights = token_weights(self.model, micro) if len(micro) > 1 else [None] * len(micro)
        total = None
        for number, (part, weight) in enumerate(zip(micro, weights)):
            last = number == len(micro) - 1
            with around(number, last) if around is not None else contextlib.nullcontext(), \
                    contextlib.ExitStack() as stack:
                for context in self.micro_contexts:
                    stack.enter_context(context())
                if self.batch_contexts:
                    part = dict(part)  # a context may shard its tensors (context parallel): the caller's batch stays
                    for context in self.batch_contexts:
                        stack.enter_context(context(part))
                for hook in self.before_micro:  # gradient sync only on the last micro-batch (parallel.py)
                    hook(self.model, last)
                self.watch.begin("forward", index)
                loss = self._forward(part)
                check_loss(loss)
                if weight is not None:
                    loss = loss * weight
                self.watch.begin("backward", index)
                if self.engine is not None:
                    self.engine.backward(loss)
                else:
                    (self.scaler.scale(loss) if self.scaler else loss).backward()
                total = loss.detach() if total is None else total + loss.detach()
                del loss
        self._mark_gradients()
        return total

    def _mark_gradients(self) -> None:
        for param in self.model.parameters():
            if param.grad is not None:
                self.watch.mark(param.grad, Category.GRADIENTS)

    def update(self, step=None) -> None:
        """The optimizer step (``step()`` instead of the recipe's step if given), then gradients zeroed.
        The recipe's step is ``opt.step()``, or ``SafeStep`` with ``safe_step``: after an out-of-memory
        error it escaped, calling ``update`` again steps only what was left."""
        index = self.count
        self.watch.begin("optimizer", index)
        if self.scaler:
            before = self.scaler.get_scale()
            self.scaler.step(self.opt)
            self.scaler.update()
            self.skipped += self.scaler.get_scale() < before  # the scale backs off only on a skip
        else:
            (step or self.stepper or self.opt.step)()
        for state in getattr(self.opt, "state", {}).values():  # torchao's CPU offload keeps none here
            for value in state.values():
                for tensor in inner_tensors(value):
                    self.watch.mark(tensor, Category.OPTIMIZER_STATE)
        self.opt.zero_grad(set_to_none=self.set_to_none)
        self.count += 1


def inner_tensors(value) -> list:
    """The tensors that hold ``value``'s memory: a tensor subclass (torchao's quantised optimizer
    state, its ``NF4Tensor`` and ``Int8Tensor`` weights) has none of its own, only the inner tensors
    ``__tensor_flatten__`` names; anything not a tensor holds none."""
    if not isinstance(value, torch.Tensor):
        return []
    if type(value) is torch.Tensor or not hasattr(value, "__tensor_flatten__"):
        return [value]
    names, _ = value.__tensor_flatten__()
    return [t for name in names for t in inner_tensors(getattr(value, name))]


WORKLOADS = ("train", "forward")


def run_steps(model, batch, *, recipe: Recipe, steps: int, optimizer=None, loss_fn=None, watch=None,
              workload: str = "train"):
    """``apply`` then ``steps`` optimizer steps (``workload="forward"``: ``steps`` forwards without
    gradients, ``Step.infer``); the loop estimate, measure and the truth share."""
    _, opt, step = apply(model, recipe, optimizer=optimizer, loss_fn=loss_fn, watch=watch)
    for _ in range(steps):
        step.infer(batch) if workload == "forward" else step(batch)
    if isinstance(opt, InBackward):
        opt.remove()
    return opt

