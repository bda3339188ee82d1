"""Candidates of ``plan`` composed from a few traces, instead of one trace each.

Tracing every candidate would take minutes for an 8B model; an ``Engine`` makes these traces once
and composes every candidate from them:

* **Graph traces**, one per (precision, LoRA, checkpointing kind, offload, chunked loss), one step
  each at two depths. With CUDA semantics the batch has a prime number of rows: a dimension that is
  a multiple of the prime is a batch dimension, and a storage's span is affine in it
  (``ledger._scaled_bytes``), so the live bytes after *every event* and each kernel's FLOPs and
  bytes are exact at any micro-batch size from that one trace (a batch of one skips a few
  contiguity copies: an upper bound there). With CPU semantics
  (kernel scratch is replayed with real tensors) or a user's batch, two batch sizes are traced and
  lined up event by event. Phase peaks and kernel times are affine in depth, as in ``depth.py``.
  From each trace come the forward peak, the backward peak with and without the gradients live at
  each event, and the kernel rows.
* **Optimizer traces**, one per (precision, LoRA, optimizer) on a short sequence: optimizer-state
  bytes, the optimizer phase's peak and kernels, and what stepping inside backward adds.
* **Composition.** Step 2's forward and backward hold the state; accumulation keeps every
  gradient live through the next micro-batch; in-backward stepping frees each gradient as it is
  made. Checkpointing every N-th block is interpolated between none and every block by the share
  of blocks checkpointed.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from memfit.planner.cost import Speed
from memfit.errors import MemfitError
from memfit.techniques.recipe import Recipe
from memfit.techniques.registry import techniques

__all__ = ["Engine", "PRIMES", "SHORT_SEQ"]

SHORT_SEQ = 32  # optimizer traces: sequence length (the optimizer does not see activations)

PRIMES = (1009, 1013, 1019, 1021, 1031)


class Engine:
    """The traces of one model, batch and step, and every candidate composed from them."""

    def __init__(self, source, batch, target, seq_len, loss_fn, optimizer, global_batch_size, progress,
                 speed: Speed | None = None):
        from memfit.estimator.depth import SHALLOW
        from memfit.estimator.estimate import FAST_MIN_DEPTH

        self.source, self.batch, self.target, self.seq_len = source, batch, target, seq_len
        self.loss_fn, self.optimizer, self.global_batch_size = loss_fn, optimizer, global_batch_size
        self.progress = progress
        # the cost model: the target's, or this CPU's (measured, seconds); a caller that reads no
        # times (``fit``) passes any
        self.speed = speed or (Speed.host() if target is None else Speed.from_gpu(target))
        self.depth = source.depth
        self.causal_lm = source.task == "causal-lm" and loss_fn is None
        self.notes: list[str] = []
        self.traces = 0
        self._graphs: dict = {}
        self._optims: dict = {}
        self._verified: dict = {}  # recipe -> full estimate
        if batch is None and self.depth and self.depth >= FAST_MIN_DEPTH:
            types = getattr(source.config, "layer_types", None)
            uniform = not isinstance(types, list) or len(set(types)) <= 1
            self.depths = (1, 2) if uniform else SHALLOW
        else:
            self.depths = (None,)
        # With CUDA semantics and a made batch, one trace per graph runs a batch of a prime size:
        # what scales with the batch is what is divisible by it. Otherwise (CPU semantics replays
        # kernel scratch with real tensors; a user batch cannot be grown) two batch sizes are traced.
        self.prime = None
        if target is not None and batch is None:
            numbers = [v for v in vars(source.config).values() if isinstance(v, int)] + [seq_len or 1]
            self.prime = next(p for p in PRIMES if all(n % p for n in numbers if n))
        self._todo = self._done = 0

    @functools.cached_property
    def has_blocks(self) -> bool:
        """Whether checkpointing finds repeated blocks to wrap (a config model's are its layers)."""
        from memfit.techniques.checkpointing import find_blocks

        if self.source.module is not None:
            return bool(find_blocks(self.source.module))
        if self.depth:
            return True
        import torch

        with torch.device("meta"):
            return bool(find_blocks(self.source.build()))

    def _graph_key(self, r: Recipe) -> tuple:
        """The values of the fields a graph trace depends on (techniques declared ``graph`` or
        ``both``, in apply's order); every N-th block is interpolated from none and every block."""
        return tuple(("off" if name == "checkpointing" and r.checkpointing.startswith("blocks:")
                      else getattr(r, name)) for name in _trace_fields("graph"))

    @staticmethod
    def _optim_key(r: Recipe) -> tuple:
        """The values of the fields an optimizer trace depends on (``optimizer`` or ``both``)."""
        return tuple(getattr(r, name) for name in _trace_fields("optimizer"))

    def _mb_points(self) -> tuple[int, ...]:
        if self.prime:
            return (self.prime,)
        m = self.global_batch_size
        return (1,) if m == 1 else (1, 2) if m == 2 else (2, m)

    def prepare(self, space) -> None:
        graphs, optims = set(), set()
        for r in space:
            graphs.add(self._graph_key(r))
            if r.checkpointing.startswith("blocks:"):
                graphs.add(self._graph_key(r.replace(checkpointing="blocks")))
            optims.add(self._optim_key(r))
        graphs -= set(self._graphs)
        optims -= set(self._optims)
        self._done = 0
        self._todo = len(self.depths) * (len(graphs) * len(self._mb_points()) + 2 * len(optims))
        for key in sorted(graphs, key=repr):
            self._graph(key)
        for key in sorted(optims, key=repr):
            self._optim(key)

    def _trace(self, depth, recipe: Recipe, batch_size: int, seq_len, steps: int, prime=None):
        from memfit.estimator.estimate import fake_trace
        from memfit.techniques.step import _slice

        source = self.source if depth is None else self.source.shallow(depth)
        batch = None
        if self.batch is not None:
            batch = _slice(self.batch() if callable(self.batch) else self.batch, 0, batch_size)
        result = fake_trace(source, batch, recipe=recipe, loss_fn=self.loss_fn, optimizer=None, steps=steps,
                            batch_size=batch_size, seq_len=seq_len, gpu=self.target, detail=True, prime=prime)
        self._done += 1
        self.traces += 1
        if self.progress:
            self.progress(self._done, self._todo)
        return result

    def _graph(self, key):
        recipe = Recipe(**dict(zip(_trace_fields("graph"), key)), optimizer="sgd")
        self._graphs[key] = {
            depth: {mb: _GraphPoint(*self._trace(depth, recipe, mb, self.seq_len, 1, self.prime), self.speed,
                                    self.prime)
                    for mb in self._mb_points()}
            for depth in self.depths}

    def _optim(self, key):
        short = None if self.seq_len is None else min(self.seq_len, SHORT_SEQ)
        found = {}
        for depth in self.depths:
            base = Recipe(**dict(zip(_trace_fields("optimizer"), key)))
            plain = self._trace(depth, base, 1, short, 2)
            try:
                inbwd = self._trace(depth, base.replace(optimizer_in_backward=True), 1, short, 2)
            except MemfitError:
                inbwd = None
            found[depth] = _optim_terms(plain, inbwd, self.speed)
        self._optims[key] = found

    def _graph_at(self, key, depth, mb) -> dict:
        points = self._graphs[key][depth]
        if mb in points:
            return points[mb].terms()
        if self.prime:
            return points[self.prime].at(mb)
        lo, hi = sorted(points)
        return points[lo].interpolate(points[hi], lo, hi, mb)

    def _share(self, r: Recipe) -> float | None:
        """Share of blocks checkpointed by ``blocks:N`` (every N-th block)."""
        if not r.checkpointing.startswith("blocks:"):
            return None
        every = int(r.checkpointing.split(":")[1])
        return math.ceil(self.depth / every) / self.depth

    def predict(self, r: Recipe):
        key = self._graph_key(r)
        share = self._share(r)
        per_depth = {}
        for depth in self.depths:
            g = self._graph_at(key, depth, r.micro_batch_size)
            if share is not None:
                full = self._graph_at(self._graph_key(r.replace(checkpointing="blocks")), depth, r.micro_batch_size)
                g = {name: g[name] + (full[name] - g[name]) * share for name in g}
            per_depth[depth] = {**g, **self._optims[self._optim_key(r)][depth]}
        terms = _extrapolate(per_depth, self.depths, self.depth)
        return self._compose(r, terms)

    def _compose(self, r: Recipe, t: dict):
        k = r.grad_accum_steps
        state = t["state"]
        # Graph traces run one step: from step 2 on, forward also holds the cuBLAS workspace that
        # backward's thread took in step 1 (``memfit.cuda``).
        t = {**t, "forward": t["forward"] + (self.target.cublas_workspace_bytes if self.target else 0)}
        if r.optimizer_in_backward:
            peak = max(t["forward"] + state, t["backward_no_grads"] + state + t["inbwd_extra"])
            step_extra = t["inbwd_seconds"]
        else:
            grads = t["grads"] if k > 1 else 0
            backward = max(t["backward"], t["backward_no_grads"] + t["grads"]) if k > 1 else t["backward"]
            peak = max(t["forward"] + state + grads, backward + state, t["optimizer"])
            step_extra = t["optimizer_seconds"]
        micro = t["forward_seconds"] + t["backward_seconds"] + 2 * self.speed.transfer_seconds(t["offloaded"])
        seconds = k * micro + step_extra
        # The caching allocator's reserved memory is known only by a full estimate (``verify``):
        # a prediction is allocated bytes plus the CUDA context.
        allocated = int(peak + max(0.0, t["rounding"]))
        device = allocated + (0 if self.target is None else self.target.cuda_context_bytes)
        reserved = None
        samples = self.global_batch_size / seconds
        tokens = samples * self.seq_len if self.seq_len and self.source.config is not None and \
            self.source.task != "image-classification" else None
        from memfit.planner.plan import Plan  # plan imports this module: the result type lives there

        return Plan(r, allocated, reserved, device, seconds, samples, tokens)

    def verify(self, r: Recipe, budget: int | None = None):
        """The full estimate of ``r`` (depth fast path for deep configs), as ``estimate`` gives it;
        with ``budget``, the allocator replayed under it (``memfit/estimator/verdict.py``)."""
        from memfit.estimator.estimate import estimate

        key = r if budget is None else (r, budget)
        if key not in self._verified:
            self.traces += 1
            batch = self.batch() if callable(self.batch) else self.batch
            device = "cpu" if self.target is None else "cuda"

            def full(recipe, budget=budget):
                return estimate(self.source, batch, recipe=recipe, loss_fn=self.loss_fn, seq_len=self.seq_len,
                                device=device, gpu=self.target, budget=budget)

            k = r.grad_accum_steps
            if batch is None and k > 5:
                # Micro-batches 2..k hold the same tensors but a few scalars (loss weights), so the
                # peak grows by the same bytes with each: traced at 2 and 3, read at k
                # (tests/test_plan.py checks it against k traced in full).
                # on the whole card, where reserved is the step's own figure unless the card runs out
                two, three = full(r.replace(grad_accum_steps=2), None), full(r.replace(grad_accum_steps=3), None)

                def line(a, b):
                    return None if a is None else b + (b - a) * (k - 3)

                peak = line(two.peak_bytes, three.peak_bytes)
                cuda = {}
                if self.target is not None:  # the line's reserved figure, judged without events
                    from memfit.estimator.verdict import FITS, fit_reserved

                    def demand(report):  # on out of memory: what it held at the limit and what was missing
                        return report.reserved_bytes + (report.missing_bytes or 0)

                    cuda = fit_reserved(peak, line(demand(two), demand(three)), self.target, budget).report_fields()
                if cuda and (cuda["verdict"] != FITS or cuda["tight"]) and k <= FULL_ACCUMULATION:
                    # Near or past the limit the line cannot say what torch does there (free and
                    # retry, expandable segments): up to FULL_ACCUMULATION micro-batches are traced
                    # and replayed; past that the line's verdict stands (a plan then reads it as tight).
                    self._verified[key] = full(r)
                else:
                    self._verified[key] = dataclasses.replace(
                        three, **{"peak_bytes": peak, **cuda}, settings={**three.settings, "recipe": r.to_dict()},
                        notes=three.notes + [f"accumulation traced over 2 and 3 micro-batches and read at {k}"])
            else:
                self._verified[key] = full(r)
        return self._verified[key]


def _trace_fields(kind: str) -> tuple[str, ...]:
    """The Recipe fields whose techniques change the ``kind`` ("graph"/"optimizer") trace."""
    return tuple(f.name for t in techniques() if t.trace in (kind, "both") for f in t.fields)


# Accumulation steps up to which a verdict near the limit is traced in full rather than read off a line.
FULL_ACCUMULATION = 16


def _extrapolate(per_depth: dict, depths, depth) -> dict:
    if depths == (None,):
        return per_depth[None]
    a, b = depths
    low, high = per_depth[a], per_depth[b]
    return {name: low[name] + (high[name] - low[name]) * (depth - a) / (b - a) for name in high}


def _phases(series, index) -> np.ndarray:
    names = np.array([p for p, _, _ in series.marks]) if series.marks else np.array([""])
    return names[index]


class _GraphPoint:
    """One graph trace: live bytes after every event and one row per kernel.

    With ``prime`` (the traced batch size), each is split into what scales with the batch and what
    does not, so ``at(x)`` gives any batch size from this one trace.
    """

    def __init__(self, report, replay, speed: Speed, prime=None):
        s = replay.series
        phases = _phases(s, s.mark)
        self.fwd, self.bwd = phases == "forward", phases == "backward"
        self.live, self.grads = s.live.astype(np.float64), s.grads.astype(np.float64)
        self.scaled = None if s.scaled is None else s.scaled.astype(np.float64)
        rows = np.asarray(replay.ops, dtype=np.float64).reshape(-1, 6)
        row_phase = _phases(s, rows[:, 0].astype(np.int64)) if len(rows) else np.array([])
        self.rows_fwd, self.rows_bwd = rows[row_phase == "forward"], rows[row_phase == "backward"]
        self.speed, self.prime = speed, prime
        self.offloaded = float(replay.offloaded_bytes)
        self.offloaded_scaled = float(replay.offloaded_scaled)

    def terms(self) -> dict:
        return self._terms(self.live, self.grads, self.rows_fwd[:, 1:4], self.rows_bwd[:, 1:4], self.offloaded)

    def _terms(self, live, grads, rows_fwd, rows_bwd, offloaded) -> dict:
        f, b = live[self.fwd], live[self.bwd]
        return {
            "forward": float(f.max()) if len(f) else 0.0,
            "backward": float(b.max()) if len(b) else 0.0,
            "backward_no_grads": float((b - grads[self.bwd]).max()) if len(b) else 0.0,
            "grads": float(grads[self.bwd].max()) if len(b) else 0.0,
            "forward_seconds": self.speed.kernel_seconds(rows_fwd),
            "backward_seconds": self.speed.kernel_seconds(rows_bwd),
            "offloaded": offloaded,
        }

    def _rows_at(self, rows, x):
        w = x / self.prime
        out = rows[:, 1:4].copy()
        out[:, 0] += rows[:, 4] * (w - 1)
        out[:, 1] += rows[:, 5] * (w - 1)
        return out

    def at(self, x: int) -> dict:
        """Terms at batch size ``x`` from a trace at the prime batch size."""
        w = x / self.prime
        live = self.live + self.scaled * (w - 1)
        return self._terms(live, self.grads, self._rows_at(self.rows_fwd, x), self._rows_at(self.rows_bwd, x),
                           self.offloaded + self.offloaded_scaled * (w - 1))

    def interpolate(self, other: "_GraphPoint", lo: int, hi: int, x: int) -> dict:
        w = (x - lo) / (hi - lo)

        def mix(a, b):
            return a + (b - a) * w

        if len(self.live) == len(other.live) and self.rows_fwd.shape == other.rows_fwd.shape \
                and self.rows_bwd.shape == other.rows_bwd.shape:
            rows_f = mix(self.rows_fwd[:, 1:4], other.rows_fwd[:, 1:4])
            rows_f[:, 2] = self.rows_fwd[:, 3]
            rows_b = mix(self.rows_bwd[:, 1:4], other.rows_bwd[:, 1:4])
            rows_b[:, 2] = self.rows_bwd[:, 3]
            return self._terms(mix(self.live, other.live), mix(self.grads, other.grads), rows_f, rows_b,
                               mix(self.offloaded, other.offloaded))
        a, b = self.terms(), other.terms()  # the two traces differ in shape: the peaks' secant
        return {name: mix(a[name], b[name]) for name in a}


def _optim_terms(plain, inbwd, speed: Speed) -> dict:
    """State bytes, the optimizer phase's peak and time, and what stepping in backward adds."""
    _, replay = plain
    s = replay.series
    phase_of = np.array([f"{p}/{st}" for p, st, _ in s.marks])
    live, grads, state = s.live.astype(np.float64), s.grads.astype(np.float64), s.state.astype(np.float64)
    opt, bwd = phase_of[s.mark] == "optimizer/1", phase_of[s.mark] == "backward/1"
    rows = np.asarray(replay.ops, dtype=np.float64).reshape(-1, 6)
    row_phase = phase_of[rows[:, 0].astype(np.int64)]
    out = {
        "state": float(state[phase_of[s.mark] == "forward/1"].max()),  # step 2 holds it throughout
        "optimizer": float(live[opt].max()),
        "optimizer_seconds": speed.kernel_seconds(rows[row_phase == "optimizer/1", 1:4]),
        "inbwd_extra": 0.0, "inbwd_seconds": 0.0,
        # CUDA: the allocator's 512-byte rounding, mostly of the many small weights, grads, states
        "rounding": 0.0 if replay.allocator is None else float(replay.allocator.peak_allocated - live.max()),
    }
    plain_bwd = float((live[bwd] - grads[bwd]).max()) - out["state"]
    plain_bwd_seconds = speed.kernel_seconds(rows[row_phase == "backward/1", 1:4])
    if inbwd is not None:
        _, r2 = inbwd
        s2 = r2.series
        phase2 = np.array([f"{p}/{st}" for p, st, _ in s2.marks])
        live2 = s2.live.astype(np.float64)
        state2 = float(s2.state[phase2[s2.mark] == "forward/1"].max())
        out["inbwd_extra"] = max(0.0, float(live2[phase2[s2.mark] == "backward/1"].max()) - state2 - plain_bwd)
        rows2 = np.asarray(r2.ops, dtype=np.float64).reshape(-1, 6)
        rp2 = phase2[rows2[:, 0].astype(np.int64)]
        out["inbwd_seconds"] = max(0.0, speed.kernel_seconds(rows2[rp2 == "backward/1", 1:4]) - plain_bwd_seconds)
    return out
