"""``plan``: the fastest recipe that fits a byte budget, and why.

The search covers precision x checkpointing (off, selective, every block, every N-th block) x
activation offload x chunked loss x optimizer (the user's, plus 8-bit states or LoRA/QLoRA when
named in ``allow``) x optimizer-in-backward x micro-batch / accumulation (exact divisors of the
global batch). Each candidate gets a predicted peak (allocated bytes, plus the CUDA context on a
GPU) and a predicted step time (``cost.py``), and the fastest candidate whose prediction fits is
checked with a full ``estimate``, which adds the caching allocator's reserved memory; a candidate
whose full estimate does not fit is passed over, so a plan never exceeds its budget by the
estimate's own account.

Tracing every candidate would take minutes for an 8B model, so candidates are composed from a few
traces (``_Engine``):

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

Written here because no library searches these axes together: Hugging Face's
``auto_find_batch_size`` and Lightning's batch finder try batch sizes on the GPU, DeepSpeed's
autotuner runs GPU trials, torch's ``activation_memory_budget`` is one knob of the compiler.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np

from memfit.cost import Speed
from memfit.errors import MemfitError
from memfit.recipe import Recipe
from memfit.units import format_size, parse_size

__all__ = ["plan", "Plan", "Plans", "NothingFits", "ALLOWABLE"]

#: What ``allow`` may name: techniques that change the math and are never chosen otherwise.
ALLOWABLE = ("lora", "qlora", "adamw8bit", "paged_adamw8bit", "bf16")
#: every N-th block checkpointed: the values of N tried (where N < depth)
EVERY = (2, 3, 4, 6, 8, 16)
LORA_RANK = 16
CHUNKS = 8
SHORT_SEQ = 32  # optimizer traces: sequence length (the optimizer does not see activations)
MAX_CHECKS = 8  # full estimates tried, fastest first, before giving up on the predictions
SMALLEST_CHECKS = 4  # then the smallest predicted, in full


@dataclass(frozen=True)
class Plan:
    """One recipe with its predicted (or, when ``verified``, fully estimated) memory and speed.

    device_bytes is what the budget is checked against: reserved + CUDA context on a GPU, the
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

    def to_dict(self) -> dict:
        return {"recipe": self.recipe.to_dict(), "describe": self.recipe.describe(),
                "allocated_bytes": self.allocated_bytes, "reserved_bytes": self.reserved_bytes,
                "device_bytes": self.device_bytes, "step_seconds": round(self.step_seconds, 6),
                "samples_per_second": round(self.samples_per_second, 3),
                "tokens_per_second": None if self.tokens_per_second is None else round(self.tokens_per_second, 1),
                "verified": self.verified, "reasons": list(self.reasons)}

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

    def __init__(self, message: str, smallest: Plan):
        super().__init__(message)
        self.smallest = smallest


def plan(model, batch=None, *, budget=None, gpu=None, global_batch_size: int | None = None,
         seq_len: int | None = None, allow=(), optimizer: str = "adamw", loss_fn=None,
         device: str | None = None, progress=None) -> Plans:
    """The fastest recipes for ``model`` that fit ``budget``, fastest first.

    model       as for :func:`memfit.estimate` (catalog name, config, nn.Module, factory).
    batch       for a model without a config: the global batch (dim 0 is split into micro-batches).
    budget      bytes or a size like ``"24GiB"``; default: the ``gpu``'s memory.
    gpu         a catalog GPU (``"rtx-4090"``): CUDA semantics and its speeds. Default ``h100-sxm``
                for speeds when only ``budget`` is given; ``device="cpu"`` plans for the CPU.
    global_batch_size  examples per optimizer step; micro-batch x accumulation divides it exactly.
    allow       names from ``ALLOWABLE`` that may change the math (LoRA, 8-bit states, pure bf16).
    optimizer   the optimizer training uses (``adamw``...); changed only to an allowed 8-bit form.
    progress    ``progress(done, total)`` called as traces complete.

    Raises ``NothingFits`` (a ``MemfitError``) when no candidate fits, naming the smallest.
    """
    from memfit.estimate import DEFAULT_GPU, _target
    from memfit.models.source import resolve

    start = time.perf_counter()
    allowed = _allowed(allow)
    device = device or "cuda"
    if gpu is not None and str(device).startswith("cpu"):
        raise MemfitError("gpu and device='cpu' conflict: drop one")
    target = _target(device, gpu if gpu is not None or str(device).startswith("cpu") else DEFAULT_GPU)
    if budget is None:
        if target is None or gpu is None:
            raise MemfitError("plan needs a budget: pass budget='24GiB' or a gpu='rtx-4090'")
        budget_bytes = target.memory_bytes
    else:
        budget_bytes = parse_size(budget)
    source = resolve(model)
    if batch is not None and not callable(batch):
        from memfit.step import _rows

        rows = _rows(batch)
        if global_batch_size not in (None, rows):
            raise MemfitError(f"global_batch_size={global_batch_size} and the batch's {rows} rows conflict: set one")
        global_batch_size = rows
    if batch is None and source.config is None:
        raise MemfitError(f"{source.name} has no config to make a batch from: pass batch= (the global batch)")
    if not isinstance(global_batch_size, int) or isinstance(global_batch_size, bool) or global_batch_size < 1:
        raise MemfitError(f"global_batch_size must be a positive integer, got {global_batch_size!r}")
    if seq_len is None and source.config is not None:
        seq_len = source.default_seq_len()
    engine = _cached_engine(source, batch, target, seq_len, loss_fn, optimizer, global_batch_size, progress)
    space = _space(engine, allowed, optimizer)
    engine.prepare(space)
    predicted = [engine.predict(r) for r in space]
    fitting = sorted((p for p in predicted if p.device_bytes <= budget_bytes), key=_rank)
    notes = list(engine.notes)
    chosen, report, rejected = None, None, 0
    for candidate in fitting[:MAX_CHECKS]:
        full = engine.verify(candidate.recipe)
        if full.device_bytes <= budget_bytes:
            chosen, report = candidate, full
            break
        rejected += 1
    if rejected:
        notes.append(f"{rejected} faster candidate(s) predicted to fit were over budget by a full estimate")
    if chosen is None:
        # Predictions are approximate where they interpolate (every N-th block) and leave out the
        # allocator's reserved memory: the smallest few are checked in full before the answer is
        # "nothing fits".
        smallest = sorted(predicted, key=lambda p: (p.device_bytes, p.step_seconds))[:SMALLEST_CHECKS]
        # the smallest is checked for the answer's figure; the others only if they could be near
        smallest = smallest[:1] + [p for p in smallest[1:] if p.device_bytes <= 1.5 * budget_bytes]
        checked = [(p, engine.verify(p.recipe)) for p in smallest if p not in fitting[:MAX_CHECKS]]
        fits = sorted(((p, full) for p, full in checked if full.device_bytes <= budget_bytes),
                      key=lambda pair: _rank(pair[0]))
        if not fits:
            raise _nothing_fits(engine, checked, budget_bytes, allowed)
        chosen, report = fits[0]
        notes.append("chosen among the smallest predicted recipes, checked in full")
    exact = Plan(chosen.recipe, report.peak_bytes, report.reserved_bytes, report.device_bytes, chosen.step_seconds,
                 chosen.samples_per_second, chosen.tokens_per_second, verified=True)
    exact = Plan(**{**exact.__dict__, "reasons": tuple(_reasons(exact, chosen, predicted, budget_bytes, engine))})
    rest = [p for p in fitting if p.recipe != chosen.recipe and _rank(p) >= _rank(chosen)]
    settings = {"model": source.name, "global_batch_size": global_batch_size, "seq_len": seq_len,
                "optimizer": optimizer, "allow": sorted(allowed), "traces": engine.traces,
                "speed": engine.speed.name}
    return Plans([exact] + rest, budget=budget_bytes, device="cpu" if target is None else "cuda",
                 gpu=None if target is None else target.name, candidates=len(predicted),
                 front=_front(predicted), seconds=time.perf_counter() - start, report=report,
                 settings=settings, notes=notes)


_ENGINES: dict = {}  # the traces of recent plans: a budget sweep traces each graph once


def _cached_engine(source, batch, target, seq_len, loss_fn, optimizer, global_batch_size, progress):
    """An engine with the traces already made for the same model, batch and step, if any.

    Only config models are cached (their key is the config's text); a module or a batch could
    change between calls without a visible difference."""
    key = None
    if source.config is not None and batch is None and source.module is None:
        key = (source.config.to_json_string(), source.task, None if target is None else target.name, seq_len,
               loss_fn, optimizer, global_batch_size)
    engine = _ENGINES.get(key) if key is not None else None
    if engine is None:
        engine = _Engine(source, batch, target, seq_len, loss_fn, optimizer, global_batch_size, progress)
        if key is not None:
            while len(_ENGINES) >= 4:
                _ENGINES.pop(next(iter(_ENGINES)))
            _ENGINES[key] = engine
    engine.progress, engine.notes, engine.traces = progress, [], 0
    return engine


def _rank(p: Plan):
    return (round(p.step_seconds, 9), p.device_bytes, p.recipe.describe())


def _allowed(allow) -> set[str]:
    if isinstance(allow, str):
        allow = [a for a in allow.split(",") if a.strip()]
    names = {str(a).strip().lower() for a in allow}
    unknown = sorted(names - set(ALLOWABLE))
    if unknown:
        raise MemfitError(f"cannot allow {', '.join(unknown)}: allow takes {', '.join(ALLOWABLE)}")
    return names


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _space(engine, allowed: set[str], optimizer: str) -> list[Recipe]:
    """Every candidate recipe; pairs ``Recipe`` rejects are skipped."""
    target = engine.target
    low = "bf16-mixed" if target is None or target.bf16 else "fp16-mixed"
    precisions = ["fp32", low] + (["bf16"] if "bf16" in allowed else [])
    depth = engine.depth or 0
    levels = ["off", "selective", "blocks"] + [f"blocks:{n}" for n in EVERY if n < depth]
    chunked = [0, CHUNKS] if engine.causal_lm else [0]
    optimizers = [optimizer] + [o for o in ("adamw8bit", "paged_adamw8bit") if o in allowed and o != optimizer]
    loras = ["off"] + [f"{k}:{LORA_RANK}" for k in ("lora", "qlora") if k in allowed]
    gbs = engine.global_batch_size
    out = []
    for precision in precisions:
        for lora in loras:
            for level in levels:
                for offload in ([False, True] if target is not None and level != "selective" else [False]):
                    for chunks in chunked:
                        for opt in optimizers:
                            for mb in _divisors(gbs):
                                for in_backward in (False, True):
                                    if in_backward and mb != gbs:
                                        continue
                                    try:
                                        out.append(Recipe(precision=precision, checkpointing=level,
                                                          offload_activations=offload, chunked_loss=chunks,
                                                          optimizer=opt, optimizer_in_backward=in_backward,
                                                          micro_batch_size=mb, grad_accum_steps=gbs // mb,
                                                          lora=lora))
                                    except MemfitError:
                                        continue
    return out


# -- the engine: traces, and candidates composed from them -----------------------------------------

PRIMES = (1009, 1013, 1019, 1021, 1031)


class _Engine:
    """The traces of one model, batch and step, and every candidate composed from them."""

    def __init__(self, source, batch, target, seq_len, loss_fn, optimizer, global_batch_size, progress):
        from memfit.depth import SHALLOW
        from memfit.estimate import FAST_MIN_DEPTH

        self.source, self.batch, self.target, self.seq_len = source, batch, target, seq_len
        self.loss_fn, self.optimizer, self.global_batch_size = loss_fn, optimizer, global_batch_size
        self.progress = progress
        self.speed = Speed.host() if target is None else Speed.from_gpu(target)
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

    def _graph_key(self, r: Recipe):
        level = "off" if r.checkpointing.startswith("blocks:") else r.checkpointing
        return (r.precision, r.lora, level, r.offload_activations, r.chunked_loss)

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
            optims.add((r.precision, r.lora, r.optimizer))
        graphs -= set(self._graphs)
        optims -= set(self._optims)
        self._done = 0
        self._todo = len(self.depths) * (len(graphs) * len(self._mb_points()) + 2 * len(optims))
        for key in sorted(graphs, key=repr):
            self._graph(key)
        for key in sorted(optims, key=repr):
            self._optim(key)

    def _trace(self, depth, recipe: Recipe, batch_size: int, seq_len, steps: int, prime=None):
        from memfit.estimate import fake_trace
        from memfit.step import _slice

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
        precision, lora, level, offload, chunks = key
        recipe = Recipe(precision=precision, lora=lora, checkpointing=level, offload_activations=offload,
                        chunked_loss=chunks, optimizer="sgd")
        self._graphs[key] = {
            depth: {mb: _GraphPoint(*self._trace(depth, recipe, mb, self.seq_len, 1, self.prime), self.speed,
                                    self.prime)
                    for mb in self._mb_points()}
            for depth in self.depths}

    def _optim(self, key):
        precision, lora, optimizer = key
        short = None if self.seq_len is None else min(self.seq_len, SHORT_SEQ)
        found = {}
        for depth in self.depths:
            base = Recipe(precision=precision, lora=lora, optimizer=optimizer)
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

    def predict(self, r: Recipe) -> Plan:
        key = self._graph_key(r)
        share = self._share(r)
        per_depth = {}
        for depth in self.depths:
            g = self._graph_at(key, depth, r.micro_batch_size)
            if share is not None:
                full = self._graph_at(self._graph_key(r.replace(checkpointing="blocks")), depth, r.micro_batch_size)
                g = {name: g[name] + (full[name] - g[name]) * share for name in g}
            per_depth[depth] = {**g, **self._optims[(r.precision, r.lora, r.optimizer)][depth]}
        terms = _extrapolate(per_depth, self.depths, self.depth)
        return self._compose(r, terms)

    def _compose(self, r: Recipe, t: dict) -> Plan:
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
        return Plan(r, allocated, reserved, device, seconds, samples, tokens)

    def verify(self, r: Recipe):
        """The full estimate of ``r`` (depth fast path for deep configs), as ``estimate`` gives it."""
        from memfit.estimate import estimate

        if r not in self._verified:
            self.traces += 1
            batch = self.batch() if callable(self.batch) else self.batch
            device = "cpu" if self.target is None else "cuda"

            def full(recipe):
                return estimate(self.source, batch, recipe=recipe, loss_fn=self.loss_fn, seq_len=self.seq_len,
                                device=device, gpu=self.target)

            k = r.grad_accum_steps
            if batch is None and k > 5:
                # Micro-batches 2..k hold the same tensors but a few scalars (loss weights), so the
                # peak grows by the same bytes with each: traced at 2 and 3, read at k
                # (tests/test_plan.py checks it against k traced in full).
                two, three = full(r.replace(grad_accum_steps=2)), full(r.replace(grad_accum_steps=3))

                def line(a, b):
                    return None if a is None else b + (b - a) * (k - 3)

                self._verified[r] = dataclasses.replace(
                    three, peak_bytes=line(two.peak_bytes, three.peak_bytes),
                    reserved_bytes=line(two.reserved_bytes, three.reserved_bytes),
                    settings={**three.settings, "recipe": r.to_dict()},
                    notes=three.notes + [f"accumulation traced over 2 and 3 micro-batches and read at {k}"])
            else:
                self._verified[r] = full(r)
        return self._verified[r]


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


# -- explaining and failing -------------------------------------------------------------------------

def _front(predicted: list[Plan]) -> list[Plan]:
    """Smallest first; each point faster than every smaller one."""
    front, best = [], math.inf
    for p in sorted(predicted, key=lambda p: (p.device_bytes, p.step_seconds)):
        if p.step_seconds < best:
            front.append(p)
            best = p.step_seconds
    return front


def _reasons(exact: Plan, chosen: Plan, predicted: list[Plan], budget: int, engine) -> list[str]:
    """For each non-default field of the choice: what leaving it out would cost or save (all
    predicted figures, so they compare like with like)."""
    table = {p.recipe: p for p in predicted}
    r = chosen.recipe
    out = []
    default = Recipe()
    speed = engine.speed.name

    def compare(field_name, alt):
        other = table.get(alt)
        if other is None:
            return
        value = getattr(r, field_name)
        if other.device_bytes > budget:
            out.append(f"{field_name}={value}: without it ({getattr(alt, field_name)}) the step needs "
                       f"{format_size(other.device_bytes)}, over the {format_size(budget)} budget")
        else:
            dt = other.step_seconds / chosen.step_seconds - 1
            out.append(f"{field_name}={value}: {abs(dt):.0%} {'faster' if dt > 0 else 'slower'} than "
                       f"{getattr(alt, field_name)} on {speed} ({format_size(chosen.device_bytes)} vs "
                       f"{format_size(other.device_bytes)})")

    for name in ("precision", "checkpointing", "offload_activations", "chunked_loss", "optimizer_in_backward",
                 "lora", "optimizer"):
        if getattr(r, name) != getattr(default, name):
            try:
                compare(name, r.replace(**{name: getattr(default, name)}))
            except MemfitError:
                pass
    if r.grad_accum_steps > 1:
        bigger = [p for p in predicted if p.recipe == r.replace(micro_batch_size=r.micro_batch_size * 2,
                                                                grad_accum_steps=r.grad_accum_steps // 2)] \
            if r.grad_accum_steps % 2 == 0 else []
        if bigger and bigger[0].device_bytes > budget:
            out.append(f"micro_batch_size={r.micro_batch_size} x {r.grad_accum_steps} accumulation steps: micro-batch "
                       f"{r.micro_batch_size * 2} needs {format_size(bigger[0].device_bytes)}, over budget")
        else:
            out.append(f"micro_batch_size={r.micro_batch_size} x {r.grad_accum_steps} accumulation steps")
    out.append(f"fits with {format_size(budget - exact.device_bytes)} to spare of {format_size(budget)} by a full "
               f"estimate ({format_size(exact.device_bytes)}; composed prediction {format_size(chosen.device_bytes)})")
    return out


def _nothing_fits(engine, checked, budget: int, allowed: set[str]) -> NothingFits:
    best, full = min(checked, key=lambda pair: pair[1].device_bytes)
    smallest = Plan(best.recipe, full.peak_bytes, full.reserved_bytes, full.device_bytes, best.step_seconds,
                    best.samples_per_second, best.tokens_per_second, verified=True)
    fixes = []
    if engine.seq_len and engine.source.task != "image-classification":
        fixes.append(f"a shorter sequence than {engine.seq_len}")
    missing = [a for a in ("lora", "qlora", "adamw8bit") if a not in allowed]
    if missing:
        fixes.append(f"allowing {','.join(missing)} (--allow)")
    if engine.target is not None:
        from memfit.gpus import CATALOG

        bigger = sorted((g for g in CATALOG.values() if g.memory_bytes >= smallest.device_bytes),
                        key=lambda g: g.memory_bytes)
        if bigger:
            fixes.append(f"a bigger card ({bigger[0].name}, {format_size(bigger[0].memory_bytes)})")
        fixes.append(f"sharding over {max(2, math.ceil(smallest.device_bytes / budget))}+ GPUs (FSDP)")
    return NothingFits(
        f"nothing fits {format_size(budget)}: the smallest recipe found ({smallest.recipe.describe()}) needs "
        f"{format_size(smallest.device_bytes)}; try " + ", or ".join(fixes), smallest)
