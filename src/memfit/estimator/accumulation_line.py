"""A long gradient accumulation read off the line through 2 and 3 micro-batches.

Tracing k micro-batches takes k times as long as one, and past a few the memory they add is the same
each time; so past ``LINE_FROM`` micro-batches an estimate traces 2 and 3 and reads the peak at k
(``fast=False`` traces every one). Near the card's limit the line cannot say what the allocator does, and
up to ``FULL_ACCUMULATION`` micro-batches the step is then traced in full.
"""

from __future__ import annotations

import dataclasses

from memfit.report.report import Report
from memfit.techniques.recipe import Recipe

__all__ = ["accumulation_line", "LINE_FROM", "FULL_ACCUMULATION"]

# Accumulation steps past which the estimate reads the peak off the line through 2 and 3 micro-batches
# (fast=False traces every one), and up to which a verdict near the limit is traced in full instead.
LINE_FROM = 5
FULL_ACCUMULATION = 16


def accumulation_line(full, r: Recipe, target, budget) -> Report:
    """The estimate of ``r``'s k > LINE_FROM micro-batches per step from traces of 2 and 3.

    Micro-batches 2..k hold the same tensors but a few scalars (loss weights) and their rows of the
    batch, so the peak grows by the same bytes with each: traced at 2 and 3, read at k (never below
    tracing all k, within 0.1 %: tests/test_plan.py). On a GPU the line's reserved figure is judged
    without events (``fit_reserved``); near or past the limit the line cannot say what torch does there
    (free and retry, expandable segments), so up to FULL_ACCUMULATION micro-batches are traced and
    replayed; past that the line's verdict stands.
    """
    k = r.grad_accum_steps
    two, three = full(r.replace(grad_accum_steps=2), None), full(r.replace(grad_accum_steps=3), None)

    def line(a, b):
        return None if a is None else b + (b - a) * (k - 3)

    peak = line(two.peak_bytes, three.peak_bytes)
    cuda = {}
    if target is not None:
        from memfit.estimator.verdict import FITS, fit_reserved

        def demand(report):  # on out of memory: what it held at the limit and what was missing
            return report.reserved_bytes + (report.missing_bytes or 0)

        cuda = fit_reserved(peak, line(demand(two), demand(three)), target, budget,
                            (three.managed_bytes or 0, three.managed_resident_bytes or 0)).report_fields()
        if (cuda["verdict"] != FITS or cuda["tight"]) and k <= FULL_ACCUMULATION:
            return full(r)
    rows = three.settings.get("batch_shapes") or []
    shapes = [[shape[0] * k // 3, *shape[1:]] if shape else shape for shape in rows]
    return dataclasses.replace(
        three, **{"peak_bytes": peak, **cuda}, settings={**three.settings, "recipe": r.to_dict(), "batch_shapes": shapes},
        step_peaks=[line(a, b) for a, b in zip(two.step_peaks, three.step_peaks)],
        phase_peaks={p: line(two.phase_peaks[p], v) for p, v in three.phase_peaks.items() if p in two.phase_peaks},
        notes=three.notes + [f"accumulation traced over 2 and 3 micro-batches and read at {k} (fast=False or --full "
                             "traces every one)"])

