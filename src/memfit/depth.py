"""The depth fast path: trace two shallow copies of a model, scale to its real depth.

A full fake trace costs ~0.3 s per block and step on 2 cores, so an 80-block model takes about
a minute. The blocks of a decoder are identical, and each phase of the step peaks at the same
place whatever the depth (end of forward, start of backward, the optimizer's largest tensor), so
every phase peak and every category at it is affine in the number of blocks. Tracing ``SHALLOW``
= (2, 4) blocks (even, so architectures alternating two kinds of layer stay whole) gives both
points of each line; the line is read at the real depth. ``tests/test_depth.py`` checks this
against a full trace.

Left out: the timeline (it would be the shallow model's) and exact module paths past block 4.
"""

from __future__ import annotations

from memfit.categories import PHASES
from memfit.estimate import fake_trace
from memfit.models.source import Source
from memfit.report import Report

__all__ = ["estimate_by_depth", "SHALLOW"]

SHALLOW = (2, 4)


def _line(low: int, high: int, depth: int) -> int:
    a, b = SHALLOW
    return low + (high - low) * (depth - a) // (b - a)


def estimate_by_depth(source: Source, *, recipe, loss_fn, optimizer, steps, batch_size, seq_len,
                      gpu=None, tick=None) -> Report:
    depth = source.depth
    (small, r_small), (big, r_big) = (
        fake_trace(source.shallow(n), None, recipe=recipe, loss_fn=loss_fn, optimizer=optimizer,
                   steps=steps, batch_size=batch_size, seq_len=seq_len, gpu=gpu, tick=tick)
        for n in SHALLOW
    )
    peaks = {key: _line(r_small.phase_peaks[key], value, depth)
             for key, value in r_big.phase_peaks.items() if key in r_small.phase_peaks}
    top = max(peaks, key=peaks.get)
    cats_small, cats_big = r_small.phase_categories[top], r_big.phase_categories[top]
    by_category = {k: _line(cats_small.get(k, 0), v, depth) for k, v in cats_big.items()}
    cuda = {}
    if gpu is not None:
        # The peak can sit in another phase in the shallow copies, so the allocator's figures are
        # not lines themselves: what is affine is the rounding added to the unrounded peak and
        # the reserved-over-allocated gap.
        rounding = [r.peak_bytes - max(r.phase_peaks.values()) for r in (small, big)]
        allocated = peaks[top] + max(0, _line(*rounding, depth))
        gap = _line(small.reserved_bytes - small.peak_bytes, big.reserved_bytes - big.peak_bytes, depth)
        cuda = dict(peak_bytes=allocated, reserved_bytes=allocated + max(0, gap),
                    context_bytes=big.context_bytes, gpu=big.gpu)
    return Report(
        peak_bytes=cuda.pop("peak_bytes", peaks[top]),
        by_category=by_category,
        phase_peaks={p: max((v for (s, ph), v in peaks.items() if ph == p), default=0) for p in PHASES},
        step_peaks=[max((v for (s, ph), v in peaks.items() if s == step and ph in PHASES), default=0)
                    for step in range(steps)],
        modules=big.modules,
        timeline=[],
        device=big.device,
        method="depth",
        modelled_bytes=_line(small.modelled_bytes, big.modelled_bytes, depth),
        unprobed_ops=max(small.unprobed_ops, big.unprobed_ops),
        parameters=_line(small.parameters, big.parameters, depth),
        trainable=_line(small.trainable, big.trainable, depth),
        settings={**big.settings, "depth": depth, "traced_depths": list(SHALLOW)},
        notes=big.notes + [
            f"traced {SHALLOW[0]} and {SHALLOW[1]} of {depth} blocks and scaled by depth; "
            "modules are those of the 4-block trace and no timeline is kept (fast=False or --full gives both)"
        ],
        **cuda,
    )
