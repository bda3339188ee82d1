"""Gradient reset: ``optimizer.zero_grad(set_to_none=...)`` after each step.

Memory: with ``set_to_none=True`` (torch's default since 2.0) gradients are freed after the step and
made again in the next backward. With ``False`` they are zeroed in place and stay allocated through
the next forward, so from step 2 on the forward peak holds a full set of gradients (older loops,
and Hugging Face's own before it switched, do this). Cost: none either way; ``False`` writes zeros.

Does not combine with: nothing; with ``optimizer_in_backward`` each gradient is freed in backward
regardless.
"""

from __future__ import annotations

from memfit.techniques.spec import Field, Technique

__all__ = ["TECHNIQUE"]


def _apply(build) -> None:
    build.set_to_none = build.recipe.set_to_none


TECHNIQUE = Technique(
    name="zero_grad",
    fields=(Field("set_to_none", True, "free gradients after each step (default); false zeroes them in place "
                  "and keeps them through the next forward", slot=105, kind="bool"),),
    order=66, apply=_apply, trace="none")
