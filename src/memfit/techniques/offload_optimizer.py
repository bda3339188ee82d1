"""Optimizer offload: optimizer state and step on the CPU (CUDA devices only).

Memory: the optimizer state (two fp32 copies of the weights for AdamW) leaves the device, and the
step runs on the host; the device keeps weights and gradients. Cost: every gradient goes to the
host and every updated weight comes back, each step.

Built on torchao's ``CPUOffloadOptimizer``.

Does not combine with: optimizer_in_backward, the 8/4-bit optimizers (their quantized states stay
on the device).
"""

from __future__ import annotations

import torch

from memfit.errors import MemfitError
from memfit.techniques.optimizer import APPROXIMATE_OPTIMIZERS, OptimizerSpec
from memfit.techniques.spec import Field, Technique

__all__ = ["offloaded", "TECHNIQUE"]


def offloaded(spec: OptimizerSpec, params) -> torch.optim.Optimizer:
    """``spec``'s optimizer with state and step on the CPU (torchao's CPUOffloadOptimizer)."""
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError:
        raise MemfitError("offload_optimizer needs torchao: pip install 'memfit[ao]'") from None
    if callable(spec):
        raise MemfitError("offload_optimizer needs an optimizer name, not a callable: pass optimizer='adamw'")
    cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}.get(spec)
    if cls is None:
        raise MemfitError(f"offload_optimizer and optimizer={spec} conflict: offload supports adamw, adam, sgd")
    return CPUOffloadOptimizer([p for p in params if p.requires_grad], cls, lr=1e-4)


def _apply(build) -> None:
    if not build.recipe.offload_optimizer:
        return
    if build.device_type != "cuda":
        raise MemfitError("offload_optimizer needs a CUDA device: on the CPU the optimizer state is "
                          "already in host memory; set offload_optimizer=false")
    spec = build.optimizer_spec
    build.make_optimizer = lambda params: offloaded(spec, params)


def _conflicts(r):
    if r.offload_optimizer and r.optimizer in APPROXIMATE_OPTIMIZERS:
        yield f"offload_optimizer and optimizer={r.optimizer} conflict: quantized states stay on the device"


TECHNIQUE = Technique(
    name="offload_optimizer",
    fields=(Field("offload_optimizer", False, "optimizer state and step on the CPU (CUDA only)", slot=80,
                  kind="bool"),),
    order=62, apply=_apply, conflicts=_conflicts, trace="none")
