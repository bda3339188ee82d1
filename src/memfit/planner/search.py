"""The candidates ``plan_ranks`` weighs: each structure traced for one rank, at the largest micro-batch that fits.

``RankSearch`` holds one search's state: the run it plans (model, card, budget, world, batch), the shallow depths
a deep model is traced at, the traces run (for the progress bar), and the candidates that fit, each a ``Plan`` with
its memory (``_Point``) and its seconds of compute and of data-parallel collectives. Two kinds of candidate:

* a data-parallel structure, alone or on a mesh with TP, EP or CP (``structure``): for each, the largest
  micro-batch that fits is found by bisection over the divisors of the per-rank batch (memory grows with the
  micro-batch), so a structure costs a few traces, not one per size. Its step time: the traced kernels of the steady
  step (``cost.py``'s roofline on the card), plus the collectives, overlapped with compute as FSDP2 prefetches and
  DDP buckets do: the step takes max(compute, communication) plus one unit's all-gather that nothing hides
  (``data_parallel.comm_seconds``), with TP's, EP's and CP's collectives and an offloaded step's host work added
  unhidden. A CP candidate is traced on the first CP rank.
* a pipeline (``pipeline``): a full per-rank estimate of every stage at pp micro-batches of one row (1F1B keeps at
  most pp in flight); its step time is the stage's share of the whole model's kernels on the same mesh over
  ``m + pp - 1`` slots, FSDP2's collectives of a stage's weights and the point-to-point sends.

A deep decoder of identical blocks is traced at 2 and 4 blocks and each candidate composed at full depth
(``_Point.at``; a shallow copy out of memory is out of memory deep, so the 4-block copy is not traced when the
2-block one is out of memory). Left out: which structures and degrees are searched, and choosing among the
candidates (``ranks.py``).

Work whose answer is already known is not done: a structure whose rank holds the budget or more outside torch's
allocator alone is out of memory at every micro-batch, untraced (``RankSearch.beyond``); the same trace (model
depth, recipe, micro-batches) asked twice in one search runs once (a pipeline's flat kernels are often a
structure's). ``runs`` counts the traces that did run.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.errors import MemfitError
from memfit.hardware.cluster import World, fake_world
from memfit.planner.cost import Speed
from memfit.planner.data_parallel import comm_seconds, offload_seconds
from memfit.planner.mesh import cp_seconds, ep_seconds, pp_seconds, pp_structure, pp_world, tp_seconds
from memfit.planner.result import Plan
from memfit.planner.terms import KernelRows, Phases
from memfit.techniques.accumulation import MAX_ACCUM_STEPS, divisors
from memfit.techniques.recipe import Recipe
from memfit.techniques.zero_config import zero_stage

__all__ = ["RankSearch", "TRACED_MICRO"]

#: micro-batches a candidate's per-rank trace runs (``RankSearch.trace``)
TRACED_MICRO = 3


@dataclass(frozen=True)
class _Point:
    """A candidate's per-rank memory and kernel seconds: one trace's, or composed at the model's depth from two
    shallow copies' (``depth.at_depth``: each phase's peak and kernel times are affine in depth; the step's peak,
    the highest of them, is not where the phase that peaks changes with depth: a shallow copy's peak in backward,
    the deep model's in the optimizer step, where the state outgrows the activations)."""

    peak_bytes: int
    reserved_bytes: int | None
    device_bytes: int
    verdict: str | None
    parameters: int
    compute: float
    retries: bool = False
    tight: bool = False
    phases: tuple = ()  # (phase, allocated peak) of each phase

    @classmethod
    def of(cls, report, compute: float) -> "_Point":
        # out of memory: what the step needs (held at the limit + missing), which is what grows with depth
        need = report.device_bytes + (report.missing_bytes or 0)
        return cls(report.peak_bytes, report.reserved_bytes, need, report.verdict, report.parameters,
                   compute, bool(report.retries), bool(report.tight), tuple(sorted(report.phase_peaks.items())))

    @classmethod
    def at(cls, low: "_Point", high: "_Point", a: int, b: int, depth: int, budget: int) -> "_Point":
        from memfit.estimator.depth import at_depth
        from memfit.estimator.verdict import FITS, OOM

        def line(x, y):
            return None if x is None or y is None else int(at_depth(x, y, a, b, depth))

        peak = line(low.peak_bytes, high.peak_bytes)
        # the highest phase at depth, each composed on its own; the device figures move with it
        lows, highs = dict(low.phases), dict(high.phases)
        phases = tuple((name, line(lows[name], highs[name])) for name in sorted(set(lows) & set(highs)))
        over = max(0, max((v for _, v in phases), default=peak) - peak)
        # the device holds at least the allocator's and the context's bytes above the allocated peak that the
        # shallow copies hold (their lines can cross below the allocated peak when the peak moves phase)
        above = min(low.device_bytes - low.peak_bytes, high.device_bytes - high.peak_bytes)
        device = max(line(low.device_bytes, high.device_bytes) + over, peak + over + max(0, above))
        reserved = line(low.reserved_bytes, high.reserved_bytes)
        # a shallow copy that does not fit: nor does the deeper model (memory grows with depth)
        fits = device <= budget and OOM not in (low.verdict, high.verdict)
        return cls(peak + over, None if reserved is None else reserved + over, device,
                   None if high.verdict is None else FITS if fits else OOM, line(low.parameters, high.parameters),
                   at_depth(low.compute, high.compute, a, b, depth), high.retries, high.tight, phases)


def _shallow_depths(source) -> tuple | None:
    """The two depths a deep decoder of identical blocks is traced at (``depth.SHALLOW``), or None: traced whole."""
    from memfit.estimator.depth import SHALLOW, layer_kinds
    from memfit.estimator.estimate import FAST_MIN_DEPTH

    depth = source.depth or 0
    if source.config is None or depth < FAST_MIN_DEPTH or len(set(layer_kinds(source.config, depth))) > 1:
        return None
    return SHALLOW


def _largest_fitting(trace, fields: dict, sizes: list[int]):
    """(recipe, report, replay) at the largest micro-batch of ``sizes`` (descending) that fits, or None."""
    from memfit.estimator.verdict import runs

    def fits(result):
        return runs(result[1].verdict)

    first = trace(fields, sizes[0])
    if fits(first):
        return first
    last = trace(fields, sizes[-1]) if len(sizes) > 1 else first
    if not fits(last):
        return None
    low, high, best = 0, len(sizes) - 1, last  # sizes[low] does not fit, sizes[high] does
    while high - low > 1:
        middle = (low + high) // 2
        result = trace(fields, sizes[middle])
        if fits(result):
            high, best = middle, result
        else:
            low = middle
    return best



class RankSearch:
    """One ``plan_ranks`` search: the run it plans, the traces it has run and the candidates that fit (``results``:
    (Plan, _Point, seconds of compute, seconds of data-parallel collectives) each, in the order found)."""

    def __init__(self, source, *, target, budget_bytes: int, world: World, global_batch_size: int, seq_len,
                 optimizer: str, loss_fn=None, progress=None, expert_params: int = 0):
        self.source, self.target, self.budget_bytes, self.world = source, target, budget_bytes, world
        self.global_batch_size, self.seq_len, self.optimizer = global_batch_size, seq_len, optimizer
        self.loss_fn, self.progress = loss_fn, progress
        self.expert_params = expert_params  # an expert-parallel model's expert parameters (FSDP2 gathers 1/ep)
        self.speed = Speed.from_gpu(target)
        self.depths = _shallow_depths(source)
        config = source.config
        self.hidden = getattr(config, "hidden_size", 0) or 0
        self.top_k = getattr(getattr(config, "text_config", None) or config, "num_experts_per_tok", None) or 1
        heads = getattr(config, "num_attention_heads", 0) or 0
        # the keys' (and values') width
        self.kv_width = (getattr(config, "num_key_value_heads", None) or heads) * (
            getattr(config, "head_dim", None) or (self.hidden // heads if heads else 0))
        self.done = self.traces = self.total = 0
        self.runs = 0  # fake traces run (``kernels``): ``traces`` less the ones answered without one, plus flat ones
        self.skipped = 0  # structures out of memory by what is outside the allocator alone (``beyond``)
        self._kernels = {}  # (depth traced, recipe, micro, traced) -> ``kernels``' answer, within this search
        self.results, self.notes = [], []
        self.estimated = {}  # a pipeline candidate's recipe -> its full per-rank estimate (every stage)
        self._flat = None  # the whole model's kernels on a pipeline's mesh (``_flat_kernels``), once traced

    def run(self, shapes: list, pipelines: list[int], staged: int) -> list:
        """Every candidate: each (split, structure) of ``shapes`` (split: the TP or CP peers that read the same rows),
        then each pipeline degree of ``pipelines`` at TP ``staged``; the candidates that fit."""
        per_rank = max(1, (self.global_batch_size // self.world.size).bit_length())
        self.total = (len(shapes) * (2 + per_rank) + 2 * len(pipelines)) * len(self.depths or (0,))
        for split, fields in shapes:
            self.structure(split, fields)
        for pp in pipelines:
            self.pipeline(pp, staged)
        return self.results

    def tick(self):
        self.done += 1
        if self.progress is not None:
            self.progress(min(self.done, self.total), self.total)

    def kernels(self, depth: int | None, recipe: Recipe, micro: int, traced: int):
        """(report, seconds of one micro-batch's kernels, seconds of the optimizer step's) of ``recipe`` traced with
        ``traced`` micro-batches of ``micro`` rows, on the model (``depth`` None) or its shallow copy of ``depth``
        blocks; once per search for the same arguments."""
        key = (depth, recipe.replace(grad_accum_steps=traced), micro, traced)
        if key not in self._kernels:
            model = self.source if depth is None else self.source.shallow(depth)
            self._kernels[key] = self._trace_kernels(model, recipe, micro, traced)
        else:
            self.tick()
        return self._kernels[key]

    def _trace_kernels(self, model, recipe: Recipe, micro: int, traced: int):
        from contextlib import nullcontext

        from memfit.estimator.fake_trace import fake_trace
        from memfit.techniques.deepspeed import torch_as_found

        self.runs += 1
        # DeepSpeed's engine patches torch as it initializes: undone after each trace (``deepspeed.torch_as_found``)
        with fake_world(self.world, 0), torch_as_found() if zero_stage(recipe) else nullcontext():
            report, replay = fake_trace(model, None, recipe=recipe.replace(grad_accum_steps=traced),
                                        loss_fn=self.loss_fn, optimizer=None, steps=2, batch_size=micro * traced,
                                        seq_len=self.seq_len, gpu=self.target, budget=self.budget_bytes, detail=True)
        self.tick()
        rows = KernelRows.of(replay.ops)
        phases = Phases(replay.series)
        micro_rows = rows.where(phases.mask(rows.marks(), "forward", 1) | phases.mask(rows.marks(), "backward", 1))
        step_rows = rows.where(phases.mask(rows.marks(), "optimizer", 1))
        speed = self.speed
        return report, speed.kernel_seconds(micro_rows.cost()) / traced, speed.kernel_seconds(step_rows.cost())

    def _one(self, depth: int | None, recipe: Recipe, micro: int, traced: int) -> _Point:
        report, per_micro, step = self.kernels(depth, recipe, micro, traced)
        return _Point.of(report, per_micro * recipe.grad_accum_steps + step)

    def beyond(self, fields: dict) -> bool:
        """Whether a rank of this structure holds the budget or more outside torch's allocator alone: the CUDA
        context, a training step's kernels, its NCCL communicators and offload streams (``verdict.run_outside``,
        as the trace counts them, less cuBLAS's, which the trace adds only when it sees a matmul). Its trace would
        leave the allocator no bytes (``verdict.limits``), so every micro-batch is out of memory: a proven answer,
        not traced (a training step allocates on the device)."""
        from memfit.estimator.verdict import run_outside

        if self.target is None or self.budget_bytes is None:
            return False
        least = run_outside(self.target, Recipe(**fields), self.world.size, matmul=False).bytes
        return least >= self.budget_bytes

    def trace(self, fields: dict, micro: int, per_rank: int):
        """(recipe, point, micro-batches traced): memory stops changing after the second micro-batch, so at most
        ``TRACED_MICRO`` run (a per-rank batch of thousands of micro-batches would trace each one, twice); the
        step's kernels are scaled to all of them."""
        from memfit.estimator.verdict import OOM

        recipe = Recipe(**fields, micro_batch_size=micro, grad_accum_steps=per_rank // micro)
        traced = min(recipe.grad_accum_steps, TRACED_MICRO)
        self.traces += 1
        if self.depths is None:
            return recipe, self._one(None, recipe, micro, traced), traced
        low = self._one(self.depths[0], recipe, micro, traced)
        if low.verdict == OOM:  # out of memory shallow: out of memory deep (``_Point.at``), the deeper copy untraced
            self.tick()
            return recipe, low, traced
        high = self._one(self.depths[1], recipe, micro, traced)
        return recipe, _Point.at(low, high, *self.depths, self.source.depth, self.budget_bytes), traced

    def structure(self, split: int, fields: dict):
        """The candidate of one structure at the largest micro-batch that fits, if any (``split``: the TP or CP peers
        that read the same rows)."""
        world, target, seq_len, depth = self.world, self.target, self.seq_len or 0, self.source.depth or 0
        per_rank = self.global_batch_size // (world.size // split)  # TP and CP peers read the same rows
        tp = fields.get("tp", 1)
        if self.beyond(fields):
            self.skipped += 1
            return
        sizes = sorted((d for d in divisors(per_rank) if per_rank // d <= MAX_ACCUM_STEPS), reverse=True)
        fit = _largest_fitting(lambda f, m: self.trace(f, m, per_rank), fields, sizes)
        if fit is None:
            return
        recipe, point, traced = fit
        dp_world = World(world.gpus // tp, world.nodes)
        micro, accum = recipe.micro_batch_size, recipe.grad_accum_steps
        # FSDP2 gathers an expert-parallel model's experts only over their copies (efsdp): 1/ep of them a rank moves
        gathered = point.parameters - self.expert_params + self.expert_params // recipe.ep
        comm, exposed = comm_seconds(recipe, dp_world, gathered, depth + 1, accum, target)
        exposed += tp_seconds(recipe, micro, seq_len, self.hidden, depth, accum, target)
        exposed += ep_seconds(recipe, micro, seq_len, self.hidden, depth, self.top_k, accum, target)
        exposed += cp_seconds(recipe, micro, seq_len, self.kv_width, depth, accum, target)
        # the host's optimizer step and the shard copies are not hidden behind the GPU's kernels
        seconds = max(point.compute, comm) + exposed + offload_seconds(recipe, dp_world, point.parameters, accum,
                                                                        target)
        samples = self.global_batch_size / seconds
        tokens = samples * self.seq_len if self.seq_len else None
        self.results.append((Plan(recipe, point.peak_bytes, point.reserved_bytes, point.device_bytes, seconds, samples,
                                  tokens, verified=False, verdict=point.verdict), point, point.compute, comm))

    def _flat_kernels(self, fields: dict):
        """(seconds of one micro-batch's kernels, of the optimizer step's, parameters) of the whole model on the
        pipeline's mesh without the pipeline, one row a micro-batch; composed at depth from the shallow copies."""
        from memfit.estimator.depth import at_depth

        flat = Recipe(**{k: v for k, v in fields.items() if k not in ("pp", "pp_schedule")}, micro_batch_size=1,
                      grad_accum_steps=1)
        source, depths = self.source, self.depths
        if depths is None:
            whole, per_micro, step = self.kernels(None, flat, 1, 1)
            return per_micro, step, whole.parameters
        (low, low_micro, low_step), (high, high_micro, high_step) = (self.kernels(d, flat, 1, 1) for d in depths)
        return (at_depth(low_micro, high_micro, *depths, source.depth), at_depth(low_step, high_step, *depths,
                                                                                  source.depth),
                int(at_depth(low.parameters, high.parameters, *depths, source.depth)))

    def pipeline(self, pp: int, staged: int):
        """The candidate of pipeline degree ``pp`` at TP ``staged``, if it fits: every stage estimated in full."""
        from memfit.estimator.estimate import estimate
        from memfit.estimator.verdict import OOM

        world, target, seq_len = self.world, self.target, self.seq_len
        fields = pp_structure(target, staged, pp, self.optimizer)
        dp = world.size // (staged * pp)
        rows = self.global_batch_size // dp
        traced = Recipe(**fields, micro_batch_size=1, grad_accum_steps=pp)
        self.traces += 1
        try:
            report = estimate(self.source, recipe=traced, batch_size=dp * pp, seq_len=seq_len, gpu=target,
                              budget=self.budget_bytes, gpus=world.gpus, nodes=world.nodes)
        except MemfitError as err:  # a model pipelining cannot cut (no model.layers, too few blocks for a stage)
            self.notes.append(f"pp={pp} passed over: {err}")
            return
        finally:
            self.tick()
        if report.verdict == OOM:
            return
        # the stage's kernels: 1/pp of the same mesh's without the pipeline (one trace for every pp degree)
        if self._flat is None:
            self._flat = self._flat_kernels(fields)
        per_micro, step, parameters = self._flat
        recipe = traced.replace(grad_accum_steps=rows)
        compute = (rows + pp - 1) * per_micro / pp + step / pp
        layers = (self.source.depth or 0) // pp
        comm, exposed = comm_seconds(recipe.replace(grad_accum_steps=1), pp_world(world, staged, pp),
                                     parameters // pp, layers + 1, 1, target)
        exposed += tp_seconds(recipe, 1, seq_len or 0, self.hidden, layers, rows + pp - 1, target)
        exposed += pp_seconds(recipe, 1, seq_len or 0, self.hidden, target, between_nodes=dp * staged >= world.gpus)
        seconds = max(compute, comm) + exposed
        plan = Plan(recipe, report.peak_bytes, report.reserved_bytes, report.device_bytes, seconds,
                    self.global_batch_size / seconds, self.global_batch_size * seq_len / seconds if seq_len else None,
                    verified=False, verdict=report.verdict)
        self.estimated[recipe] = report
        self.results.append((plan, _Point.of(report, compute), compute, comm))
