"""The depth fast path: trace a shallow copy of a model, write out its log at the real depth.

A full fake trace costs ~0.3 s per block and step on 2 cores, so an 80-block model takes about
a minute. The blocks of a decoder are identical, so a copy with four blocks (the first, a second,
a middle one and the last; four pairs where the model alternates two kinds of layer) holds every
pattern of the deep model's step. ``accounting/synth.py`` writes the deep model's allocation log
from the shallow one (the middle block repeated, references between neighbouring blocks kept),
and the log is replayed exactly as a full trace's is: the replay gives the unrounded peak, its
categories, the phase peaks and the timeline, and on a GPU the caching-allocator model gives
``max_memory_allocated`` and ``max_memory_reserved``. The reserved-over-allocated gap is not a line
in depth (which cached segment a request lands in depends on all before it), which is why the
stream is replayed rather than two shallow traces' figures extrapolated, as this module did before.

``tests/test_depth.py`` and ``bench/fast_vs_full.py`` check it against full traces.

Left out: module paths past the fourth block name the block the record was written as (the
deep model's index), but kernel scratch sites keep the shallow copy's names.
"""

from __future__ import annotations

import dataclasses
import math

from memfit.accounting.replay import replay
from memfit.errors import MemfitError
from memfit.accounting.synth import synthesise
from memfit.techniques.checkpointing import checkpoint_plan
from memfit.estimator.fake_trace import fake_trace
from memfit.models.source import Source
from memfit.report.report import Report
from memfit.estimator.trace import fold_peaks, numel
from memfit.estimator.verdict import cuda_fit

__all__ = ["estimate_by_depth", "SHALLOW", "TEMPLATE_UNITS", "block_unit", "at_depth"]

# The depths the planner traces to compose candidates (``compose.py``): even, so architectures
# alternating two kinds of layer stay whole.
SHALLOW = (2, 4)
# Units (blocks, or pairs of blocks) of the copy the fast path traces: a first, a second, a
# middle one (written out for every middle unit of the deep model) and the last.
TEMPLATE_UNITS = 4


def at_depth(low, high, a: int, b: int, depth: int):
    """A figure at ``depth`` blocks from the same figure traced at ``a`` and ``b`` blocks: phase peaks
    and kernel times are affine in depth (the blocks are identical). The planner composes its
    candidates this way (``planner/terms.py``); ``estimate`` writes the log out instead (above)."""
    return low + (high - low) * (depth - a) / (b - a)


def block_unit(source: Source, recipe=None) -> int | None:
    """Blocks per repeated unit: 2 where the config alternates layer kinds (``layer_types``), times
    N with ``checkpointing=blocks:N`` (every N-th block is wrapped); None where the blocks follow no
    period (``checkpointing=modules:...``), which the full trace handles."""
    types = getattr(source.config, "layer_types", None)
    unit = 1 if not isinstance(types, list) or len(set(types)) <= 1 else 2
    if recipe is not None:
        kind, every = checkpoint_plan(recipe.checkpointing)
        if kind == "modules":
            return None
        if kind == "blocks":
            unit = math.lcm(unit, every)
    return unit


def estimate_by_depth(source: Source, *, recipe, loss_fn, optimizer, steps, batch_size, seq_len,
                      gpu=None, budget: int | None = None, tick=None, layout=None, workload: str = "train") -> Report:
    if recipe.compile:
        raise MemfitError("compile and the depth fast path conflict: a compiled step (whole or per block) has no "
                          "per-block records to write out; trace it in full (fast=False, --full)")
    depth, unit = source.depth, block_unit(source, recipe)
    # safe_step's chunks are cut by the bytes of all parameters, not per block: traced in full
    if unit is None or not depth or depth % unit or depth <= TEMPLATE_UNITS * unit or recipe.safe_step is not None:
        report, _ = fake_trace(source, None, recipe=recipe, loss_fn=loss_fn, optimizer=optimizer, steps=steps,
                               batch_size=batch_size, seq_len=seq_len, gpu=gpu, budget=budget, tick=tick,
                               layout=layout, workload=workload)
        return report
    blocks = TEMPLATE_UNITS * unit
    shallow = source.shallow(blocks)
    small, result = fake_trace(shallow, None, recipe=recipe, loss_fn=loss_fn, optimizer=optimizer, steps=steps,
                               batch_size=batch_size, seq_len=seq_len, gpu=gpu, keep=True, tick=tick, layout=layout, workload=workload)
    log = synthesise(result.ledger, depth=depth, unit=unit)
    if log.unmatched and getattr(recipe, "parallel", "none") != "none":
        # FSDP2's units with a free the written log cannot place (selective checkpointing recomputing
        # under a gathered unit): the written log would keep buffers alive, so the step is traced in full
        report, _ = fake_trace(source, None, recipe=recipe, loss_fn=loss_fn, optimizer=optimizer, steps=steps,
                               batch_size=batch_size, seq_len=seq_len, gpu=gpu, budget=budget, tick=None,
                               layout=layout, workload=workload)
        return dataclasses.replace(report, notes=report.notes + [
            f"traced in full: the depth fast path could not place {log.unmatched} free(s) of the {blocks}-block copy"])
    full = replay(log, result.scratch)
    cuda = {}
    if gpu is not None:
        # the written log is replayed under the card's limit like a full trace's (``verdict.py``)
        cuda = dict(cuda_fit(log, gpu, budget).report_fields(), context_bytes=small.context_bytes, gpu=small.gpu)
    parameters, trainable = _parameters(result.ledger, log)
    notes = small.notes + [f"traced {blocks} of {depth} blocks and wrote the step's allocations out for all "
                           f"{depth} (fast=False or --full traces them all)"]
    if log.unmatched:
        notes.append(f"{log.unmatched} free(s) of the shallow trace had no counterpart at full depth")
    return Report(
        peak_bytes=cuda.pop("peak_bytes", full.peak_bytes),
        by_category=full.by_category,
        **fold_peaks(full.phase_peaks, steps),
        modules=full.modules,
        timeline=full.timeline,
        device=small.device,
        method="depth",
        modelled_bytes=full.scratch_at_peak,
        unprobed_ops=small.unprobed_ops,
        parameters=parameters,
        trainable=trainable,
        settings={**small.settings, "depth": depth, "traced_depths": [blocks]},
        notes=notes,
        **cuda,
    )


def _parameters(ledger, log) -> tuple[int, int]:
    """Logical weights and trainable weights of the deep model: each parameter of the shallow copy
    counted once per block its block was written as."""
    root = ledger.root  # the class name as built (FSDP2 renames the class of what it shards)
    total = trainable = 0
    for name, param in ledger.model.named_parameters():
        owner = f"{root}.{name.rsplit('.', 1)[0]}" if "." in name else root
        weights = log.copies(owner) * numel(param)
        total += weights
        trainable += weights if param.requires_grad else 0
    return total, trainable
