"""Optimizer offload: optimizer state and step on the CPU (CUDA devices only).

Memory: the optimizer state (two fp32 copies of the weights for AdamW) leaves the device, and the
step runs on the host; the device keeps weights and gradients. Cost: every gradient goes to the
host and every updated weight comes back, each step.

Built on torchao's ``CPUOffloadOptimizer``. An estimate for a card runs that same optimizer on the
fake trace (whose tensors all stand for the GPU's, made on the CPU) with what it asks of CUDA answered
for the block (``_on_fake``: its device, streams and events, pinned memory): its copies of each
parameter and gradient and its per-parameter optimizers' state and step are put in host memory by the
ledger (``on_host``), the rest is the GPU's, as torchao places it: parameters below its
``minimal_size`` stay with an optimizer on the device, each gradient is copied to the host as it is
accumulated and the updated weights copied back in place. Left out: the copies' timing (its side
stream: the GPU's gradients are freed at ``zero_grad``, as they are).

Does not combine with: optimizer_in_backward, the 8/4-bit optimizers (their quantized states stay
on the device).
"""

from __future__ import annotations

import contextlib

import torch

from memfit.errors import MemfitError
from memfit.techniques.optimizer import APPROXIMATE_OPTIMIZERS, OptimizerSpec
from memfit.techniques.spec import Field, Technique

__all__ = ["offloaded", "TECHNIQUE"]


def offloaded(spec: OptimizerSpec, params, offload_gradients: bool = False) -> torch.optim.Optimizer:
    """``spec``'s optimizer with state and step on the CPU (torchao's CPUOffloadOptimizer); ``offload_gradients``:
    each gradient freed on the GPU once it is copied to the host (torchao's option of that name)."""
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError:
        raise MemfitError("offload_optimizer needs torchao: pip install 'memfit[ao]'") from None
    if callable(spec):
        raise MemfitError("offload_optimizer needs an optimizer name, not a callable: pass optimizer='adamw'")
    cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}.get(spec)
    if cls is None:
        raise MemfitError(f"offload_optimizer and optimizer={spec} conflict: offload supports adamw, adam, sgd")
    return CPUOffloadOptimizer([p for p in params if p.requires_grad], cls, lr=1e-4,
                               offload_gradients=offload_gradients)


class _Stream:
    """A CUDA stream or event that orders nothing: the fake trace has no concurrency."""

    def wait_stream(self, *args, **kwargs):
        return None

    def record_event(self, *args, **kwargs):
        return self

    def synchronize(self):
        return None


@contextlib.contextmanager
def _on_fake():
    """What CPUOffloadOptimizer asks of CUDA, answered on a fake trace made on the CPU."""
    import torchao.optim.cpu_offload as cpu_offload

    from memfit.scoped import patched

    empty_like = torch.empty_like

    def unpinned(*args, pin_memory=False, **kwargs):  # pinned memory needs a GPU; ``on_host`` counts it
        return empty_like(*args, **kwargs)

    with contextlib.ExitStack() as scope:
        scope.enter_context(patched(cpu_offload, "get_available_devices", lambda: ["cpu", "cuda"]))
        for name, value in (("Stream", lambda *a, **k: _Stream()), ("current_stream", lambda *a, **k: _Stream()),
                            ("stream", lambda *a, **k: contextlib.nullcontext())):
            scope.enter_context(patched(torch.cuda, name, value))
        scope.enter_context(patched(torch, "empty_like", unpinned))
        scope.enter_context(patched(torch.Tensor, "record_stream", lambda self, stream: None))
        yield


def _fake_offloaded(spec: OptimizerSpec, params, watch, offload_gradients: bool) -> torch.optim.Optimizer:
    """``offloaded`` on a fake trace under CUDA semantics: the optimizer's host side marked (``watch.on_host``)."""
    with _on_fake(), watch.on_host(pinned=True):
        optimizer = offloaded(spec, params, offload_gradients)
    for inner in optimizer.optim_dict.values():  # each offloaded parameter's own optimizer steps on the host
        inner.step = _hosted(inner.step, watch)
    step = optimizer.step

    def stepped(closure=None):
        from memfit.categories import Category

        out = step(closure)  # inside the step's contexts: ``_on_fake`` answers its CUDA calls
        # its state is its optimizers' (it keeps no ``state`` of its own): the small parameters' on the GPU, the rest's
        # on the host
        for inner in [optimizer.d_opt, *optimizer.optim_dict.values()]:
            for state in (inner.state.values() if inner is not None else ()):
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        watch.mark(value, Category.OPTIMIZER_STATE)
        return out

    optimizer.step = stepped
    return optimizer


def _hosted(step, watch):
    def on_host(*args, **kwargs):
        with watch.on_host():
            return step(*args, **kwargs)

    return on_host


def _apply(build) -> None:
    if not build.recipe.offload_optimizer:
        return
    spec, grads = build.optimizer_spec, build.recipe.offload_gradients
    if build.device_type != "cuda":
        if getattr(build.watch, "cublas_workspace", None) is None:  # not a trace for a card
            raise MemfitError("offload_optimizer needs a CUDA device: on the CPU the optimizer state is "
                              "already in host memory; set offload_optimizer=false")
        build.make_optimizer = lambda params: _fake_offloaded(spec, params, build.watch, grads)
        build.step_contexts.append(_on_fake)  # its backward hooks copy each gradient on a side stream
        return
    build.make_optimizer = lambda params: offloaded(spec, params, grads)


def _conflicts(r):
    if r.offload_optimizer and r.optimizer in APPROXIMATE_OPTIMIZERS:
        yield f"offload_optimizer and optimizer={r.optimizer} conflict: quantized states stay on the device"
    if r.offload_gradients and not r.offload_optimizer:
        yield "offload_gradients needs offload_optimizer: add offload_optimizer=true, or drop offload_gradients"
    if r.offload_gradients and r.grad_accum_steps > 1:
        yield (f"offload_gradients and grad_accum_steps={r.grad_accum_steps} conflict: torchao frees each gradient "
               "after its copy, so none accumulates; drop one")


TECHNIQUE = Technique(
    name="offload_optimizer",
    fields=(Field("offload_optimizer", False, "optimizer state and step on the CPU (CUDA only)", slot=80,
                  kind="bool"),
            Field("offload_gradients", False, "with offload_optimizer: each gradient freed on the GPU once copied to "
                  "the host (torchao's; no accumulation)", slot=81, kind="bool")),
    order=62, apply=_apply, conflicts=_conflicts, trace="none")
