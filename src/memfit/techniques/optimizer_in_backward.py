"""Optimizer step in backward: each parameter steps as soon as its gradient is accumulated.

Memory: gradients never all exist at once; each is freed right after its parameter's step
(``register_post_accumulate_grad_hook``), so the gradient peak shrinks to about one layer's.
Measured on CPU: no gain when the peak is at the start of backward (large batches), -8% to -22%
with small batches or checkpointing. Cost: none in FLOPs; no gradient clipping across parameters.

Does not combine with: grad_accum_steps > 1 (nothing to accumulate into), fp16-mixed (the scaler
must see every gradient first), offload_optimizer.
"""

from __future__ import annotations

import functools
import weakref

import torch

from memfit.techniques.spec import Field, Technique

__all__ = ["InBackward", "TECHNIQUE"]


class InBackward(torch.optim.Optimizer):
    """One optimizer per parameter, stepped from the parameter's post-accumulate-grad hook.

    Presents itself as a single optimizer (``param_groups``, ``state``, ``step``, ``zero_grad``,
    ``state_dict``) so the training loop is unchanged: ``step`` and ``zero_grad`` are no-ops, the hooks
    did the work. Its one group holds every parameter, with the inner optimizers' hyperparameters; what
    an LR scheduler (or anyone) writes there is copied to a parameter's own optimizer before it steps,
    as torchtune's ``OptimizerInBackwardWrapper`` keeps one scheduler for all of them. ``load_state_dict``
    puts each parameter's state back into its own optimizer.
    """

    def __init__(self, params, make):
        params = [p for p in params if p.requires_grad]
        self.optimizers = {p: make([p]) for p in params}
        # the hooks hold this wrapper weakly: a parameter -> hook -> wrapper -> parameter cycle would keep a
        # finished run's model alive until the garbage collector's next full pass
        this = weakref.ref(self)
        self.handles = [p.register_post_accumulate_grad_hook(functools.partial(_hook, this)) for p in params]
        first = next(iter(self.optimizers.values()), None)
        defaults = dict(first.defaults) if first is not None else {}
        super().__init__(params, defaults)

    def _step(self, param):
        opt = self.optimizers[param]
        groups = self.param_groups  # the scheduler's lr (and any other hyperparameter set there)
        outer = groups[0] if len(groups) == 1 else next(
            (g for g in groups if any(p is param for p in g["params"])), None)
        if outer is not None:
            for group in opt.param_groups:
                for key, value in outer.items():
                    if key == "params" or key not in group:
                        continue
                    if isinstance(group[key], torch.Tensor) and not isinstance(value, torch.Tensor):
                        group[key].fill_(value)  # torchao keeps lr a tensor (for its compiled step), refuses a float
                    else:
                        group[key] = value
        opt.step()
        opt.zero_grad(set_to_none=True)

    @property
    def state(self):
        merged = {}
        for opt in self.optimizers.values():
            merged.update(opt.state)
        return merged

    @state.setter
    def state(self, value):  # torch.optim.Optimizer.__init__ assigns it
        pass

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)  # the groups; the state lands in __dict__, under the property
        for param, value in self.__dict__.pop("state", {}).items():
            if param in self.optimizers:
                self.optimizers[param].state[param] = value

    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none: bool = True):
        return None

    def remove(self):
        for handle in self.handles:
            handle.remove()


def _hook(this, param) -> None:
    wrapper = this()
    if wrapper is not None:
        wrapper._step(param)


def _apply(build) -> None:
    if build.recipe.optimizer_in_backward:
        inner = build.make_optimizer
        build.make_optimizer = lambda params: InBackward(params, inner)


def _conflicts(r):
    if r.optimizer_in_backward and r.grad_accum_steps > 1:
        yield ("optimizer_in_backward and grad_accum_steps > 1 conflict: the step happens in every backward, "
               "so gradients cannot accumulate; set grad_accum_steps=1")
    if r.optimizer_in_backward and r.precision == "fp16-mixed":
        yield ("optimizer_in_backward and precision=fp16-mixed conflict: the GradScaler must see every gradient "
               "before stepping; use bf16-mixed")
    if r.optimizer_in_backward and r.offload_optimizer:
        yield "optimizer_in_backward and offload_optimizer conflict: choose one"


TECHNIQUE = Technique(
    name="optimizer_in_backward",
    fields=(Field("optimizer_in_backward", False, "step each parameter as its gradient is ready", slot=70,
                  kind="bool"),),
    order=64, apply=_apply, conflicts=_conflicts, trace="composed",
    search=lambda ctx: [{"optimizer_in_backward": False}, {"optimizer_in_backward": True}])
