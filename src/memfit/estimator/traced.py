"""One estimate of one step on one device: the depth fast path or a full fake trace.

``estimate`` resolves its arguments, then asks this module for each trace it needs: once, once per
micro-batch shape of variable-length data (``shapes.py``), or once per kind of rank (``sharded.py``).
Here is the choice between writing a 4-block copy out at full depth (``depth.py``) and tracing the
whole model (``fake_trace.py``), and the progress ticker every trace reports through.
"""

from __future__ import annotations

import dataclasses

from memfit.errors import MemfitError
from memfit.estimator.fake_trace import fake_trace
from memfit.estimator.rebudget import spoil
from memfit.estimator.shapes import shape_note
from memfit.report.report import Report

__all__ = ["traced", "ticker", "FAST_MIN_DEPTH"]

# Below this depth a full trace is cheap enough that the fast path buys nothing.
FAST_MIN_DEPTH = 8


def traced(source, batch, *, recipe, loss_fn, factory, steps, batch_size, seq_len, target, budget, fast, tick,
           layout, placement=None, workload: str = "train", stage=None) -> Report:
    """One estimate: the depth fast path or a full trace; with ``layout``, of that micro-batch shape; with ``stage``
    (a pipeline stage and its blocks), of that stage's rank."""
    if layout is not None:
        batch_size = layout.rows * recipe.grad_accum_steps
        if recipe.micro_batch_size and recipe.micro_batch_size != layout.rows:  # a last, shorter micro-batch
            recipe = recipe.replace(micro_batch_size=layout.rows)
    if fast and recipe.compile:
        raise MemfitError("fast=True and compile conflict: a compiled step has no per-block records for the depth "
                          "fast path to write out; leave fast unset (compiled steps are traced in full)")
    if fast and recipe.offload_optimizer and target is not None:
        raise MemfitError("fast=True and offload_optimizer conflict on a card: the depth fast path does not yet write "
                          "out which records are the host's; leave fast unset (traced in full)")
    if fast is None:
        # compiled code runs outside the blocks' records, and an offloaded optimizer's host records are not written
        # out at depth: both in full
        fast = (source.config is not None and batch is None and (source.depth or 0) >= FAST_MIN_DEPTH
                and not recipe.compile and not (recipe.offload_optimizer and target is not None))
    if fast and batch is None and source.config is not None and source.depth:  # else nothing to scale: traced in full
        from memfit.estimator.depth import estimate_by_depth

        spoil("depth fast path: a shallow trace written out at full depth")
        report = estimate_by_depth(source, recipe=recipe, loss_fn=loss_fn, optimizer=factory, steps=steps,
                                   batch_size=batch_size, seq_len=seq_len, gpu=target, budget=budget, tick=tick,
                                   layout=layout, workload=workload, stage=stage)
    else:
        report, _ = fake_trace(source, batch, recipe=recipe, loss_fn=loss_fn, optimizer=factory, steps=steps,
                               batch_size=batch_size, seq_len=seq_len, gpu=target, budget=budget, tick=tick,
                               layout=layout, placement=placement, workload=workload)
    if layout is None:
        return report
    return dataclasses.replace(report, micro_batch=layout.summary(), notes=report.notes + [shape_note(layout)])


def ticker(progress, total: int):
    """A ``tick()`` that reports ``progress(done, total)``; None without a progress callable."""
    if progress is None:
        return None
    done = 0
    progress(done, total)

    def tick():
        nonlocal done
        done = min(done + 1, total)
        progress(done, total)

    return tick
