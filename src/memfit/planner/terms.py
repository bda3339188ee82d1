"""What the planner reads off its traces: the terms a candidate is composed from (``compose.py``).

A graph trace (one step, no optimizer state) gives ``GraphTerms``: the forward peak, the backward
peak with and without the gradients live at each event, the gradients, the kernel time of each
phase and the offloaded bytes. An optimizer trace (two steps on a short sequence) gives
``OptimizerTerms``: the state's bytes, the optimizer phase's peak and time, and what stepping
inside backward adds. Both are plain numbers, so points at two batch sizes, two depths or two
checkpointing levels are combined field by field.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from memfit.estimator.depth import at_depth
from memfit.planner.cost import Speed

__all__ = ["GraphTerms", "OptimizerTerms", "GraphPoint", "KernelRows", "Phases", "optimizer_terms", "lerp",
           "lerp_terms", "terms_at_depth"]


@dataclass(frozen=True)
class GraphTerms:
    """One graph trace's figures (bytes and seconds as floats), at one batch size and depth."""

    forward: float  # highest live bytes in forward
    backward: float  # highest live bytes in backward
    backward_no_grads: float  # highest live bytes in backward, less the gradients live at each event
    grads: float  # highest gradient bytes live in backward
    forward_seconds: float  # forward's kernel time (``cost.py``)
    backward_seconds: float  # backward's kernel time
    offloaded: float  # activation bytes offloaded to the host (each way)


@dataclass(frozen=True)
class OptimizerTerms:
    """One optimizer trace's figures (step 2 of two: the state exists throughout)."""

    state: float  # optimizer-state bytes held from step 2's forward on
    optimizer: float  # highest live bytes in the optimizer phase
    optimizer_seconds: float  # the optimizer phase's kernel time
    inbwd_extra: float  # stepping inside backward: bytes over plain backward's peak (0 if it cannot)
    inbwd_seconds: float  # stepping inside backward: seconds over plain backward's kernels
    rounding: float  # CUDA: the allocator's 512-byte rounding, mostly of the many small weights, grads, states
    managed: float = 0.0  # CUDA: paged optimizer state in managed memory, outside every figure above


def lerp(a, b, w):
    """``a + (b - a) * w``: numbers or arrays, between two traces (batch sizes, checkpointing levels)."""
    return a + (b - a) * w


def lerp_terms(a, b, w: float):
    """``lerp`` of every field of two terms of the same type."""
    return type(a)(**{f.name: lerp(getattr(a, f.name), getattr(b, f.name), w) for f in fields(a)})


def terms_at_depth(per_depth: dict, depths: tuple, depth):
    """The terms at the model's ``depth`` from those traced at the two ``depths`` (``depth.at_depth``),
    or the full model's where it was traced whole (``depths == (None,)``)."""
    if depths == (None,):
        return per_depth[None]
    a, b = depths
    low, high = per_depth[a], per_depth[b]
    return type(high)(**{f.name: at_depth(getattr(low, f.name), getattr(high, f.name), a, b, depth)
                         for f in fields(high)})


class Phases:
    """The phase and step of each of a trace's marks (``Series.marks``), decoded once."""

    def __init__(self, series):
        marks = series.marks or [("", -1, 0)]
        self.phase = np.array([p for p, _, _ in marks])
        self.step = np.array([st for _, st, _ in marks])

    def mask(self, index, phase: str, step: int | None = None) -> np.ndarray:
        """Which of the marks ``index`` (an array of mark indices) fall in ``phase`` (of ``step``)."""
        found = self.phase[index] == phase
        return found if step is None else found & (self.step[index] == step)


# The columns of a kernel row (``accounting/ops.py``): the mark it ran under; its FLOPs, bytes moved and
# math dtype code; and the FLOPs and bytes that scale with the batch (in a trace at a prime batch size).
MARK, FLOPS, BYTES, DTYPE, FLOPS_SCALED, BYTES_SCALED = range(6)
COST = slice(FLOPS, DTYPE + 1)  # (FLOPs, bytes, dtype code): what ``Speed.kernel_seconds`` reads


@dataclass(frozen=True)
class KernelRows:
    """A trace's kernel rows, one per kernel."""

    table: np.ndarray  # N x 6 float64, columns MARK ... BYTES_SCALED

    @classmethod
    def of(cls, ops) -> "KernelRows":
        return cls(np.asarray(ops, dtype=np.float64).reshape(-1, 6))

    def marks(self) -> np.ndarray:
        return self.table[:, MARK].astype(np.int64)

    def where(self, mask) -> "KernelRows":
        return KernelRows(self.table[mask])

    def cost(self) -> np.ndarray:
        """(FLOPs, bytes, dtype code) of each row: a view."""
        return self.table[:, COST]

    def cost_at(self, w: float) -> np.ndarray:
        """(FLOPs, bytes, dtype code) at ``w`` times the traced batch (a new array)."""
        out = self.cost().copy()
        out[:, 0] += self.table[:, FLOPS_SCALED] * (w - 1)
        out[:, 1] += self.table[:, BYTES_SCALED] * (w - 1)
        return out


class GraphPoint:
    """One graph trace: live bytes after every event and one row per kernel.

    With ``prime`` (the traced batch size), each is split into what scales with the batch and what
    does not, so ``at(x)`` gives any batch size from this one trace.
    """

    def __init__(self, report, replay, speed: Speed, prime=None):
        s = replay.series
        phases = Phases(s)
        self.fwd, self.bwd = phases.mask(s.mark, "forward"), phases.mask(s.mark, "backward")
        self.live, self.grads = s.live.astype(np.float64), s.grads.astype(np.float64)
        self.scaled = None if s.scaled is None else s.scaled.astype(np.float64)
        rows = KernelRows.of(replay.ops)
        marks = rows.marks()
        self.rows_fwd = rows.where(phases.mask(marks, "forward"))
        self.rows_bwd = rows.where(phases.mask(marks, "backward"))
        self.speed, self.prime = speed, prime
        self.offloaded = float(replay.offloaded_bytes)
        self.offloaded_scaled = float(replay.offloaded_scaled)

    def terms(self) -> GraphTerms:
        return self._terms(self.live, self.grads, self.rows_fwd.cost(), self.rows_bwd.cost(), self.offloaded)

    def _terms(self, live, grads, cost_fwd, cost_bwd, offloaded) -> GraphTerms:
        f, b = live[self.fwd], live[self.bwd]
        return GraphTerms(
            forward=float(f.max()) if len(f) else 0.0,
            backward=float(b.max()) if len(b) else 0.0,
            backward_no_grads=float((b - grads[self.bwd]).max()) if len(b) else 0.0,
            grads=float(grads[self.bwd].max()) if len(b) else 0.0,
            forward_seconds=self.speed.kernel_seconds(cost_fwd),
            backward_seconds=self.speed.kernel_seconds(cost_bwd),
            offloaded=offloaded,
        )

    def at(self, x: int) -> GraphTerms:
        """Terms at batch size ``x`` from a trace at the prime batch size."""
        w = x / self.prime
        live = self.live + self.scaled * (w - 1)
        return self._terms(live, self.grads, self.rows_fwd.cost_at(w), self.rows_bwd.cost_at(w),
                           self.offloaded + self.offloaded_scaled * (w - 1))

    def interpolate(self, other: "GraphPoint", lo: int, hi: int, x: int) -> GraphTerms:
        """Terms at batch size ``x`` between this trace (at ``lo``) and ``other`` (at ``hi``): event by
        event where the two line up, else the secant of their peaks."""
        w = (x - lo) / (hi - lo)
        if len(self.live) == len(other.live) and self.rows_fwd.table.shape == other.rows_fwd.table.shape \
                and self.rows_bwd.table.shape == other.rows_bwd.table.shape:
            cost_f = lerp(self.rows_fwd.cost(), other.rows_fwd.cost(), w)
            cost_f[:, 2] = self.rows_fwd.table[:, DTYPE]  # a dtype code is not mixed
            cost_b = lerp(self.rows_bwd.cost(), other.rows_bwd.cost(), w)
            cost_b[:, 2] = self.rows_bwd.table[:, DTYPE]
            return self._terms(lerp(self.live, other.live, w), lerp(self.grads, other.grads, w), cost_f, cost_b,
                               lerp(self.offloaded, other.offloaded, w))
        return lerp_terms(self.terms(), other.terms(), w)  # the two traces differ in shape: the peaks' secant


def optimizer_terms(plain, inbwd, speed: Speed) -> OptimizerTerms:
    """State bytes, the optimizer phase's peak and time, and what stepping in backward adds, from
    (report, replay) of two steps, plain and (None if it cannot) with the optimizer in backward."""
    _, replay = plain
    s = replay.series
    phases = Phases(s)
    live, grads, state = s.live.astype(np.float64), s.grads.astype(np.float64), s.state.astype(np.float64)
    opt, bwd = phases.mask(s.mark, "optimizer", 1), phases.mask(s.mark, "backward", 1)
    rows = KernelRows.of(replay.ops)
    marks = rows.marks()
    held = float(state[phases.mask(s.mark, "forward", 1)].max())  # step 2 holds it throughout
    inbwd_extra = inbwd_seconds = 0.0
    plain_bwd = float((live[bwd] - grads[bwd]).max()) - held
    plain_bwd_seconds = speed.kernel_seconds(rows.where(phases.mask(marks, "backward", 1)).cost())
    if inbwd is not None:
        _, r2 = inbwd
        s2 = r2.series
        phases2 = Phases(s2)
        live2 = s2.live.astype(np.float64)
        state2 = float(s2.state[phases2.mask(s2.mark, "forward", 1)].max())
        inbwd_extra = max(0.0, float(live2[phases2.mask(s2.mark, "backward", 1)].max()) - state2 - plain_bwd)
        rows2 = KernelRows.of(r2.ops)
        bwd2 = rows2.where(phases2.mask(rows2.marks(), "backward", 1))
        inbwd_seconds = max(0.0, speed.kernel_seconds(bwd2.cost()) - plain_bwd_seconds)
    return OptimizerTerms(
        state=held,
        optimizer=float(live[opt].max()),
        optimizer_seconds=speed.kernel_seconds(rows.where(phases.mask(marks, "optimizer", 1)).cost()),
        inbwd_extra=inbwd_extra,
        inbwd_seconds=inbwd_seconds,
        rounding=0.0 if replay.allocator is None else float(replay.allocator.peak_allocated - live.max()),
        managed=float(replay.managed_bytes),
    )
