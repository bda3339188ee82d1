"""Candidates of ``plan`` composed from a few traces, instead of one trace each.

Tracing every candidate would take minutes for an 8B model; an ``Engine`` makes these traces once
and composes every candidate from them:

* **Graph traces**, one per (precision, LoRA, checkpointing kind, offload, chunked loss), one step
  each at two depths. With CUDA semantics the batch has a prime number of rows: a dimension that is
  a multiple of the prime is a batch dimension, and a storage's span is affine in it
  (``events.scaled_bytes``), so the live bytes after *every event* and each kernel's FLOPs and
  bytes are exact at any micro-batch size from that one trace (a batch of one skips a few
  contiguity copies: an upper bound there). With CPU semantics
  (kernel scratch is replayed with real tensors) or a user's batch, two batch sizes are traced and
  lined up event by event. Phase peaks and kernel times are affine in depth (``depth.at_depth``).
  From each trace come the forward peak, the backward peak with and without the gradients live at
  each event, and the kernel rows (``terms.py``: ``GraphTerms``).
* **Optimizer traces**, one per (precision, LoRA, optimizer) on a short sequence: optimizer-state
  bytes, the optimizer phase's peak and kernels, and what stepping inside backward adds
  (``OptimizerTerms``).
* **Composition.** Step 2's forward and backward hold the state; accumulation keeps every
  gradient live through the next micro-batch; in-backward stepping frees each gradient as it is
  made. Checkpointing every N-th block is interpolated between none and every block by the share
  of blocks checkpointed.
"""

from __future__ import annotations

import collections
import functools
import math

from memfit.planner.cost import Speed
from memfit.planner.result import Plan
from memfit.planner.terms import GraphPoint, GraphTerms, OptimizerTerms, lerp_terms, optimizer_terms, terms_at_depth
from memfit.errors import MemfitError
from memfit.techniques.recipe import Recipe
from memfit.techniques.registry import techniques

__all__ = ["Engine", "PRIMES", "SHORT_SEQ"]

SHORT_SEQ = 32  # optimizer traces: sequence length (the optimizer does not see activations)

PRIMES = (1009, 1013, 1019, 1021, 1031)

KEEP_REPLAYS = 4  # unbudgeted full estimates whose events an engine keeps for a replay under a budget


class Engine:
    """The traces of one model, batch and step, and every candidate composed from them."""

    def __init__(self, source, batch, target, seq_len, loss_fn, optimizer, global_batch_size, progress,
                 speed: Speed | None = None):
        from memfit.estimator.depth import SHALLOW
        from memfit.estimator.estimate import FAST_MIN_DEPTH

        self.source, self.batch, self.target, self.seq_len = source, batch, target, seq_len
        self.loss_fn, self.optimizer, self.global_batch_size = loss_fn, optimizer, global_batch_size
        # a callable ``params -> Optimizer``: the optimizer traces and full estimates build it as the
        # user wrote it (the recipes' ``optimizer`` field is then the placeholder ``recipe_from`` puts)
        self.factory = optimizer if callable(optimizer) else None
        # What the traces refused, each with the reason, so ``offered`` drops the candidates that
        # need it (the full estimate checking them would refuse them the same way):
        self.no_inbwd: dict = {}  # optim key -> why stepping in backward could not be traced
        self.refused: dict = {}  # ("graph" | "optimizer", key) -> why that trace failed (``prepare``)
        self.no_mb: dict = {}  # micro-batch size -> why the model refused a batch of that many rows
        self._refusable = False
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
        self._verified: dict = {}  # recipe, or (recipe, budget) -> full estimate
        # recipe -> what replaying its unbudgeted estimate under a budget needs (``estimator/rebudget.py``), for
        # the last few verified only: ``plan`` asks for a recipe under its budget right after the unbudgeted
        # estimate (``_checked``), and each holds a whole trace's records and events
        self._replays: collections.OrderedDict = collections.OrderedDict()
        self.replays = 0  # budgeted estimates made by a replay instead of a trace
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

    def prepare(self, space, refusable: bool = False) -> None:
        """Trace what ``space`` needs. With ``refusable`` (``plan``: a search), a trace the model or
        step refuses drops the candidates that need it (``offered``) instead of ending the search,
        unless it is the plain step's own (no technique: nothing could be planned): a technique
        that cannot apply to this model (LoRA without linear layers), or a micro-batch of one row a
        model refuses (``BatchNorm1d`` in training)."""
        self._refusable = refusable
        graphs, optims = set(), set()
        for r in space:
            graphs.add(self._graph_key(r))
            if r.checkpointing.startswith("blocks:"):
                graphs.add(self._graph_key(r.replace(checkpointing="blocks")))
            optims.add(self._optim_key(r))
        graphs -= set(self._graphs)
        optims -= set(self._optims)
        if refusable:  # refused in an earlier call on this engine: refused again
            graphs -= {key for kind, key in self.refused if kind == "graph"}
            optims -= {key for kind, key in self.refused if kind == "optimizer"}
        self._done = 0
        self._todo = len(self.depths) * (len(graphs) * len(self._mb_points()) + 2 * len(optims))
        plain = Recipe(optimizer=self.recipe_optimizer)
        for kind, keys, make, base in (("graph", graphs, self._graph, self._graph_key(plain)),
                                       ("optimizer", optims, self._optim, self._optim_key(plain))):
            for key in sorted(keys, key=repr):
                try:
                    make(key)
                except MemfitError as err:
                    if not refusable or key == base:
                        raise
                    self.refused[kind, key] = str(err)

    @property
    def recipe_optimizer(self) -> str:
        """The recipes' ``optimizer``: the name, or for a custom optimizer its placeholder."""
        from memfit.planner.space import optimizer_name

        return optimizer_name(self.optimizer)

    def _trace(self, depth, recipe: Recipe, batch_size: int, seq_len, steps: int, prime=None, factory=None):
        from memfit.estimator.fake_trace import fake_trace
        from memfit.techniques.step import batch_slice

        source = self.source if depth is None else self.source.shallow(depth)
        batch = None
        if self.batch is not None:
            batch = batch_slice(self.batch() if callable(self.batch) else self.batch, 0, batch_size)
        result = fake_trace(source, batch, recipe=recipe, loss_fn=self.loss_fn, optimizer=factory, steps=steps,
                            batch_size=batch_size, seq_len=seq_len, gpu=self.target, detail=True, prime=prime)
        self._done += 1
        self.traces += 1
        if self.progress:
            self.progress(self._done, self._todo)
        return result

    def _graph(self, key):
        recipe = Recipe(**dict(zip(_trace_fields("graph"), key)), optimizer="sgd")
        found, one_row = {}, None
        for depth in self.depths:
            points = {}
            for mb in self._mb_points():
                if mb in self.no_mb:
                    continue
                try:
                    points[mb] = GraphPoint(*self._trace(depth, recipe, mb, self.seq_len, 1, self.prime), self.speed,
                                            self.prime)
                except MemfitError as err:
                    if not self._one_row(mb):
                        raise
                    one_row = str(err)  # a user batch of two rows: traced at 2 alone (if 2 is refused: raised)
            found[depth] = points
        if one_row is not None:
            self.no_mb[1] = one_row
        self._graphs[key] = found

    def _one_row(self, mb: int) -> bool:
        """Whether a trace refused at micro-batch ``mb`` may be read as the model refusing one row
        (then traced at the next size, and micro-batch 1 not offered): a search over a user batch
        of more than one row."""
        return self._refusable and mb == 1 and self.batch is not None and self.global_batch_size > 1

    def _optim_trace(self, depth, recipe: Recipe, seq_len):
        """(trace, rows) of two steps of ``recipe`` on one row (the optimizer sees no activations),
        or on the smallest larger micro-batch where the model refuses one row (``no_mb``)."""
        rows = min(p for p in self._mb_points() if p > 1) if self._one_row(1) else 1
        if 1 in self.no_mb:
            return self._trace(depth, recipe, rows, seq_len, 2, factory=self.factory), rows
        try:
            return self._trace(depth, recipe, 1, seq_len, 2, factory=self.factory), 1
        except MemfitError as err:
            if not self._one_row(1):
                raise
            self._todo += 1
            found = self._trace(depth, recipe, rows, seq_len, 2, factory=self.factory)  # refused too: raised
            self.no_mb[1] = str(err)
            return found, rows

    def _optim(self, key):
        short = None if self.seq_len is None else min(self.seq_len, SHORT_SEQ)
        found = {}
        for depth in self.depths:
            base = Recipe(**dict(zip(_trace_fields("optimizer"), key)))
            plain, rows = self._optim_trace(depth, base, short)
            try:
                probe = base.replace(optimizer_in_backward=True)
            except MemfitError:  # a pair Recipe refuses (fp16-mixed): never a candidate
                probe = None
            inbwd = None
            if probe is not None:
                try:
                    inbwd = self._trace(depth, probe, rows, short, 2, factory=self.factory)
                except MemfitError as err:
                    # the plain step traced, stepping in backward did not (a custom optimizer that
                    # cannot step one parameter at a time): its candidates are not offered
                    # (``offered``), since the full estimate that checks them would refuse them too
                    self.no_inbwd.setdefault(key, str(err))
            found[depth] = optimizer_terms(plain, inbwd, self.speed)
        self._optims[key] = found

    def offered(self, r: Recipe) -> bool:
        """Whether ``r`` is a candidate its traces could make: none of its traces was refused
        (``refused``, ``no_mb``; stepping in backward: ``no_inbwd``)."""
        graphs = [self._graph_key(r)]
        if r.checkpointing.startswith("blocks:"):
            graphs.append(self._graph_key(r.replace(checkpointing="blocks")))
        return not (any(("graph", key) in self.refused for key in graphs)
                    or ("optimizer", self._optim_key(r)) in self.refused
                    or r.micro_batch_size in self.no_mb
                    or (r.optimizer_in_backward and self._optim_key(r) in self.no_inbwd))

    def _graph_at(self, key, depth, mb) -> GraphTerms:
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

    def predict(self, r: Recipe, budget: int | None = None) -> Plan:
        """``r``'s predicted memory and step time; ``budget`` (bytes, context included): the room
        paged optimizer state has beside the prediction, whose overflow the step pays to page."""
        key = self._graph_key(r)
        share = self._share(r)
        graphs, optims = {}, {}
        for depth in self.depths:
            g = self._graph_at(key, depth, r.micro_batch_size)
            if share is not None:
                full = self._graph_at(self._graph_key(r.replace(checkpointing="blocks")), depth, r.micro_batch_size)
                g = lerp_terms(g, full, share)
            graphs[depth] = g
            optims[depth] = self._optims[self._optim_key(r)][depth]
        return self._compose(r, terms_at_depth(graphs, self.depths, self.depth),
                             terms_at_depth(optims, self.depths, self.depth), budget)

    def _compose(self, r: Recipe, g: GraphTerms, o: OptimizerTerms, budget: int | None = None) -> Plan:
        k = r.grad_accum_steps
        state = o.state
        # Graph traces run one step: from step 2 on, forward also holds the cuBLAS workspace that
        # backward's thread took in step 1 (``memfit.cuda``).
        forward = g.forward + (self.target.cublas_workspace_bytes if self.target else 0)
        if r.optimizer_in_backward:
            peak = max(forward + state, g.backward_no_grads + state + o.inbwd_extra)
            step_extra = o.inbwd_seconds
        else:
            grads = g.grads if k > 1 else 0
            backward = max(g.backward, g.backward_no_grads + g.grads) if k > 1 else g.backward
            peak = max(forward + state + grads, backward + state, o.optimizer)
            step_extra = o.optimizer_seconds
        micro = g.forward_seconds + g.backward_seconds + 2 * self.speed.transfer_seconds(g.offloaded)
        seconds = k * micro + step_extra
        # The caching allocator's reserved memory is known only by a full estimate (``verify``):
        # a prediction is allocated bytes plus what the process holds outside the allocator.
        allocated = int(peak + max(0.0, o.rounding))
        device = allocated + (0 if self.target is None else self.target.outside_bytes)
        if o.managed and budget is not None:  # paged state beyond the card's room moves each step
            seconds += self.speed.paging_seconds(o.managed - max(budget - device, 0))
        reserved = None
        samples = self.global_batch_size / seconds
        tokens = samples * self.seq_len if self.seq_len and self.source.config is not None and \
            self.source.task != "image-classification" else None
        return Plan(r, allocated, reserved, device, seconds, samples, tokens)

    def verify(self, r: Recipe, budget: int | None = None):
        """The full estimate of ``r`` (depth fast path for deep configs), as ``estimate`` gives it;
        with ``budget``, the allocator replayed under it (``memfit/estimator/verdict.py``): where the
        unbudgeted estimate was one plain trace, its events replayed under the budget, without a new trace
        (``memfit/estimator/rebudget.py``; the same report a budgeted estimate makes, field by field)."""
        from memfit.estimator.rebudget import rebudgeted

        key = r if budget is None else (r, budget)
        if key not in self._verified and budget is not None and r in self._replays and r in self._verified:
            self.replays += 1
            self._verified[key] = rebudgeted(self._verified[r], self._replays[r], budget)
        if key not in self._verified:
            self._verified[key] = self._estimate(r, budget)
        return self._verified[key]

    def _estimate(self, r: Recipe, budget: int | None):
        """``estimate`` of ``r`` under ``budget``: a trace (two or three reading accumulation off a line);
        unbudgeted, what a replay under a budget needs is kept if it was one plain trace."""
        from memfit.estimator.estimate import estimate
        from memfit.estimator.rebudget import recording, replayable

        self.traces += 1
        batch = self.batch() if callable(self.batch) else self.batch
        device = "cpu" if self.target is None else "cuda"
        custom = {} if self.factory is None else {"optimizer": self.factory}
        with recording() as found:
            # k > 5 micro-batches: estimate reads them off the line through 2 and 3 (_accumulation_line)
            report = estimate(self.source, batch, recipe=r, loss_fn=self.loss_fn, seq_len=self.seq_len,
                              device=device, gpu=self.target, budget=budget, **custom)
        replay = replayable(found, report) if budget is None and self.target is not None else None
        if replay is not None:
            self._replays[r] = replay
            while len(self._replays) > KEEP_REPLAYS:
                self._replays.popitem(last=False)
        return report

def _trace_fields(kind: str) -> tuple[str, ...]:
    """The Recipe fields whose techniques change the ``kind`` ("graph"/"optimizer") trace."""
    return tuple(f.name for t in techniques() if t.trace in (kind, "both") for f in t.fields)

