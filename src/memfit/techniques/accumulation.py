"""Gradient accumulation: the optimizer step's batch in micro-batches, one forward/backward each.

Memory: activations are those of one micro-batch; the gradients of every parameter stay live from
the first micro-batch's backward to the step. Cost: more, smaller kernels (a GPU is less busy
with small micro-batches); the update equals the whole batch's because each micro-batch's loss is
weighted by its share of the labelled tokens (``step.token_weights``).

Does not combine with: optimizer_in_backward (nothing to accumulate into).
"""

from __future__ import annotations

import math

from memfit.errors import MemfitError, shown
from memfit.techniques.spec import Field, Technique
from memfit.techniques.step import split_batch

__all__ = ["divisors", "MAX_ACCUM_STEPS", "MAX_BATCH", "TECHNIQUE"]

# Bounds: past these an estimate would trace for hours (every micro-batch runs) or sizes would
# overflow 64-bit byte counts; no training step is near them.
MAX_ACCUM_STEPS = 1024
MAX_BATCH = 1 << 24


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]  # pairs (d, n // d): sqrt(n) steps
    return sorted(set(small + [n // d for d in small]))


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_steps(value) -> None:
    if not _int(value) or not 1 <= value <= MAX_ACCUM_STEPS:
        raise MemfitError(f"grad_accum_steps must be an integer from 1 to {MAX_ACCUM_STEPS}, got "
                          f"{shown(value)}: memory stops changing after the second "
                          "micro-batch, so a smaller count gives the same peak")


def _check_micro(value) -> None:
    if value is not None and (not _int(value) or not 1 <= value <= MAX_BATCH):
        raise MemfitError(f"micro_batch_size must be an integer from 1 to {MAX_BATCH}, got {shown(value)}")


def _apply(build) -> None:
    parts, size = build.recipe.grad_accum_steps, build.recipe.micro_batch_size
    build.split = lambda batch: split_batch(batch, parts, size)


def _search(ctx):
    gbs = ctx.global_batch_size
    return [{"micro_batch_size": mb, "grad_accum_steps": gbs // mb} for mb in divisors(gbs)]


TECHNIQUE = Technique(
    name="accumulation",
    fields=(Field("micro_batch_size", None, "examples per forward/backward", slot=90, kind="optional-count",
                  check=_check_micro),
            Field("grad_accum_steps", 1, "micro-batches per optimizer step", slot=100, kind="count",
                  check=_check_steps)),
    order=63, apply=_apply, search=_search, trace="composed")
