"""``Fit``, the answer of ``fit``: the largest micro-batch of a recipe that fits a budget, and
``NoBatchFits``, raised when micro-batch 1 does not.

Both ``fit`` on one device (``fit.py``) and across data-parallel ranks (``fit_ranks.py``) answer with them;
``memfit fit --json`` prints ``Fit.to_dict()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memfit.errors import MemfitError
from memfit.techniques.recipe import Recipe
from memfit.units import format_size

__all__ = ["edge_note", "Fit", "NoBatchFits"]


@dataclass(frozen=True)
class Fit:
    """The largest micro-batch of ``recipe`` that fits ``budget_bytes``, checked by full estimates.

    ``device_bytes`` is the full estimate at ``micro_batch_size`` (reserved + context on a GPU);
    ``next_bytes`` the full estimate one size up (``None`` when the search stopped at ``limit``).
    """

    recipe: Recipe  # the user's recipe with micro_batch_size set to the answer
    micro_batch_size: int
    grad_accum_steps: int
    budget_bytes: int
    device_bytes: int
    allocated_bytes: int
    reserved_bytes: int | None
    next_bytes: int | None
    predicted_micro_batch_size: int | None  # from the composed traces, before verification
    tokens_per_example: int | None  # sequence length for token models, else None
    estimates: int  # full estimates the verification consulted (a repeated call finds them kept)
    traces: int  # planner traces the prediction took (0 when the cache passed held them)
    seconds: float
    device: str  # "cuda" or "cpu"
    gpu: str | None
    model: str
    report: object = field(repr=False, compare=False, default=None)  # the Report at the answer
    notes: tuple[str, ...] = ()
    ranks: int = 1  # data-parallel ranks (``fit(gpus=...)``): the micro-batch is each rank's

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.ranks

    @property
    def tokens_per_step(self) -> int | None:
        return None if self.tokens_per_example is None else self.global_batch_size * self.tokens_per_example

    @property
    def at_limit(self) -> bool:
        return self.next_bytes is None

    def to_dict(self) -> dict:
        return {"fits": True, "model": self.model, "device": self.device, "gpu": self.gpu,
                "micro_batch_size": self.micro_batch_size, "grad_accum_steps": self.grad_accum_steps,
                "global_batch_size": self.global_batch_size, "tokens_per_step": self.tokens_per_step,
                "ranks": self.ranks,
                "budget_bytes": self.budget_bytes, "device_bytes": self.device_bytes,
                "allocated_bytes": self.allocated_bytes, "reserved_bytes": self.reserved_bytes,
                "margin_bytes": self.budget_bytes - self.device_bytes,
                "next": {"micro_batch_size": self.micro_batch_size + 1, "device_bytes": self.next_bytes},
                "predicted_micro_batch_size": self.predicted_micro_batch_size,
                "estimates": self.estimates, "traces": self.traces, "seconds": round(self.seconds, 2),
                "recipe": self.recipe.to_dict(), "notes": list(self.notes)}

    def __str__(self) -> str:
        return (f"micro-batch {self.micro_batch_size} x {self.grad_accum_steps} = global batch "
                f"{self.global_batch_size}: {format_size(self.device_bytes)} of {format_size(self.budget_bytes)}")


class NoBatchFits(MemfitError):
    """Micro-batch 1 of the recipe does not fit; ``needed_bytes`` is its full estimate."""

    def __init__(self, message: str, needed_bytes: int, budget_bytes: int):
        super().__init__(message)
        self.needed_bytes, self.budget_bytes = needed_bytes, budget_bytes



#: a card's answer closer to its limit than this share of the budget is closer than the estimate's error on a real
#: card (reserved: median 0.73 %, bench/results/gpu-check-h200.json)
EDGE = 0.005


def edge_note(n: int, budget: int, needed: int, next_bytes: int | None) -> list[str]:
    """A note when micro-batch ``n`` leaves less than ``EDGE`` of a card's budget: measured on an H200, such an edge
    is decided by the allocator's retries and cuDNN's algorithm choice, not by the estimate."""
    spare = budget - needed
    if spare >= EDGE * budget:
        return []
    step = (next_bytes - needed) if next_bytes is not None and next_bytes > needed else None
    fewer = ""
    if step is not None:
        fewer = f"; micro-batch {max(1, n - -(-(int(EDGE * budget) - spare) // step))} leaves {EDGE * 100:g} %"
    return [f"micro-batch {n} leaves {format_size(spare)} ({100 * spare / budget:.2f} % of the budget, under "
            f"{EDGE * 100:g} %): closer than the estimate's error on a real card, where the allocator's retries and "
            f"cuDNN's choice of algorithms decide such an edge (an H200's ResNet-50 ran out at memfit's answer, "
            f"bench/results/fit-edge-h200.json){fewer}"]
