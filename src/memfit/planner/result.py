"""What ``plan`` answers: a ``Plan`` (one recipe with its memory and speed), ``Plans`` (those that
fit, fastest first) and ``NothingFits`` (no recipe fits: the smallest one found)."""

from __future__ import annotations

from dataclasses import dataclass

from memfit.errors import MemfitError
from memfit.techniques.recipe import Recipe
from memfit.units import format_size

__all__ = ["Plan", "Plans", "NothingFits", "CLEAN_SLOWDOWN", "clean"]

#: a candidate that fits only with a setting (expandable segments) or tightly is taken over clean ones
#: that are slower than it by more than this factor (fused AdamW made fp32 recipes fit an H200 cleanly
#: at 746 tokens/s beside a bf16-mixed one needing expandable segments at 6,847)
CLEAN_SLOWDOWN = 1.25


def clean(report) -> bool:
    """Fits as the allocator is set by default, with no cudaFree-and-retry and the error to spare."""
    if report.verdict is None:
        return True
    from memfit.estimator.verdict import FITS

    return report.verdict == FITS and not report.retries and not report.tight



@dataclass(frozen=True)
class Plan:
    """One recipe with its predicted (or, when ``verified``, fully estimated) memory and speed.

    device_bytes is what the budget is checked against: reserved + what the process holds outside the allocator on a GPU (nvidia-smi's figure), the
    peak on the CPU. Step time covers one optimizer step of the whole global batch.
    """

    recipe: Recipe
    allocated_bytes: int
    reserved_bytes: int | None
    device_bytes: int
    step_seconds: float
    samples_per_second: float
    tokens_per_second: float | None
    verified: bool = False
    reasons: tuple[str, ...] = ()
    verdict: str | None = None  # on a GPU, the full estimate's (``fit.py``): fits, or only with expandable segments
    seq_len: int | None = None  # the rows' length the plan's micro-batch was estimated at (None: not a token model)

    @property
    def alloc_conf(self) -> str | None:
        """The ``PYTORCH_CUDA_ALLOC_CONF`` setting this plan needs, if any."""
        from memfit.estimator.verdict import EXPANDABLE

        return "expandable_segments:True" if self.verdict == EXPANDABLE else None

    def to_dict(self) -> dict:
        return {"recipe": self.recipe.to_dict(), "describe": self.recipe.describe(),
                "allocated_bytes": self.allocated_bytes, "reserved_bytes": self.reserved_bytes,
                "device_bytes": self.device_bytes, "step_seconds": round(self.step_seconds, 6),
                "samples_per_second": round(self.samples_per_second, 3),
                "tokens_per_second": None if self.tokens_per_second is None else round(self.tokens_per_second, 1),
                "verified": self.verified, "reasons": list(self.reasons), "verdict": self.verdict,
                "alloc_conf": self.alloc_conf, "seq_len": self.seq_len}

    def __str__(self) -> str:
        speed = (f"{self.tokens_per_second:,.0f} tokens/s" if self.tokens_per_second is not None
                 else f"{self.samples_per_second:,.2f} samples/s")
        return (f"{self.recipe.describe()}: {format_size(self.device_bytes)}, "
                f"{self.step_seconds * 1000:,.0f} ms/step, {speed}")


class Plans(list):
    """Plans that fit the budget, fastest first; ``plans[0]`` is the choice (checked by a full
    estimate, ``plans.report``), the rest are predicted to fit. ``front``: the predicted
    memory/speed front of all candidates, smallest first, each faster than every smaller one."""

    def __init__(self, items, *, budget: int, device: str, gpu: str | None, candidates: int, front: list,
                 seconds: float, report, settings: dict, notes: list[str]):
        super().__init__(items)
        self.budget, self.device, self.gpu = budget, device, gpu
        self.candidates, self.front, self.seconds = candidates, front, seconds
        self.report, self.settings, self.notes = report, settings, notes

    @property
    def best(self) -> Plan:
        return self[0]

    def to_dict(self) -> dict:
        return {"budget_bytes": self.budget, "device": self.device, "gpu": self.gpu,
                "candidates": self.candidates, "seconds": round(self.seconds, 2), "settings": self.settings,
                "best": self[0].to_dict(), "fitting": [p.to_dict() for p in self[:20]],
                "front": [p.to_dict() for p in self.front], "notes": self.notes}


class NothingFits(MemfitError):
    """No recipe fits: the smallest one found, and what would make one fit."""

    def __init__(self, message: str, smallest: Plan | None):
        # an answer, not bad input: every fix it names (each from an estimate) is kept, on one line
        ValueError.__init__(self, " ".join(str(message).split()))
        self.smallest = smallest
