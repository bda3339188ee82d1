"""``fit``: the largest micro-batch of a recipe that fits a budget.

The planner's traces (``compose.py``) give the live bytes after every event as an affine function
of the micro-batch, so the peak of any micro-batch size is read from one or two traces: the
largest size predicted to fit is found by bisection on those predictions, without tracing. The
prediction leaves out the caching allocator's reserved memory, so the answer is then *verified*
by full ``estimate`` calls: the candidate, and the size one above it. A full estimate that
disagrees with the prediction rescales it, then a line through the full estimates either side of
the edge points to the next size to try (bisection if that keeps missing), down or up, until a
size fits by a full estimate and the next size up does not. ``Fit.estimates``
says how many full estimates that took.

What the answer means: by ``estimate``'s own account (reserved + the memory outside the allocator on a
GPU, the allocator's peak on the CPU), micro-batch ``n`` of this recipe fits and ``n + 1`` does
not. It inherits the estimate's accuracy; the test checks it against the CPU allocator.

Known limitations:
* Recipes with ``attention`` or ``offload_optimizer`` set are outside the planner's traces: the
  search then doubles and bisects with full estimates only (a few more of them).
* A user's batch is grown (or shrunk) to each size by making tensors of the same shape past
  dim 0, dtype and contents zero: memory does not depend on values on fake tensors, but a
  model whose shapes depend on the data (packed sequences, padding masks) is measured as zeros.
* The search stops at ``limit`` examples per micro-batch (default 65536).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from memfit.errors import MemfitError, shown
from memfit.techniques.recipe import Recipe, recipe_from
from memfit.units import format_size, parse_size
from memfit.estimator.checkpoint import checkpoint_recipe
from memfit.estimator.verdict import FITS, OOM

__all__ = ["fit", "Fit", "NoBatchFits", "LIMIT"]

LIMIT = 65536  # the largest micro-batch searched
PROBE = 4  # without a prime-size trace: the second batch size traced (the first is 2)


@dataclass(frozen=True)
class Fit:
    """The largest micro-batch of ``recipe`` that fits ``budget_bytes``, checked by full estimates.

    ``device_bytes`` is the full estimate at ``micro_batch_size`` (reserved + context on a GPU);
    ``next_bytes`` the full estimate one size up (``None`` when the search stopped at ``limit``).
    """

    recipe: Recipe  # the user's recipe with micro_batch_size set to the answer
    micro_batch_size: int
    grad_accum_steps: int
    budget_bytes: int
    device_bytes: int
    allocated_bytes: int
    reserved_bytes: int | None
    next_bytes: int | None
    predicted_micro_batch_size: int | None  # from the composed traces, before verification
    tokens_per_example: int | None  # sequence length for token models, else None
    estimates: int  # full estimates the verification consulted (a repeated call finds them kept)
    traces: int  # planner traces the prediction took (0 when the cache passed held them)
    seconds: float
    device: str  # "cuda" or "cpu"
    gpu: str | None
    model: str
    report: object = field(repr=False, compare=False, default=None)  # the Report at the answer
    notes: tuple[str, ...] = ()
    ranks: int = 1  # data-parallel ranks (``fit(gpus=...)``): the micro-batch is each rank's

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.ranks

    @property
    def tokens_per_step(self) -> int | None:
        return None if self.tokens_per_example is None else self.global_batch_size * self.tokens_per_example

    @property
    def at_limit(self) -> bool:
        return self.next_bytes is None

    def to_dict(self) -> dict:
        return {"fits": True, "model": self.model, "device": self.device, "gpu": self.gpu,
                "micro_batch_size": self.micro_batch_size, "grad_accum_steps": self.grad_accum_steps,
                "global_batch_size": self.global_batch_size, "tokens_per_step": self.tokens_per_step,
                "ranks": self.ranks,
                "budget_bytes": self.budget_bytes, "device_bytes": self.device_bytes,
                "allocated_bytes": self.allocated_bytes, "reserved_bytes": self.reserved_bytes,
                "margin_bytes": self.budget_bytes - self.device_bytes,
                "next": {"micro_batch_size": self.micro_batch_size + 1, "device_bytes": self.next_bytes},
                "predicted_micro_batch_size": self.predicted_micro_batch_size,
                "estimates": self.estimates, "traces": self.traces, "seconds": round(self.seconds, 2),
                "recipe": self.recipe.to_dict(), "notes": list(self.notes)}

    def __str__(self) -> str:
        return (f"micro-batch {self.micro_batch_size} x {self.grad_accum_steps} = global batch "
                f"{self.global_batch_size}: {format_size(self.device_bytes)} of {format_size(self.budget_bytes)}")


class NoBatchFits(MemfitError):
    """Micro-batch 1 of the recipe does not fit; ``needed_bytes`` is its full estimate."""

    def __init__(self, message: str, needed_bytes: int, budget_bytes: int):
        super().__init__(message)
        self.needed_bytes, self.budget_bytes = needed_bytes, budget_bytes


def fit(model, batch=None, *, gpu=None, budget=None, recipe: Recipe | None = None, precision: str = "fp32",
        optimizer: str = "adamw", seq_len: int | None = None, loss_fn=None, device: str | None = None,
        limit: int = LIMIT, progress=None, cache=None, gpus: int | None = None, nodes: int | None = None) -> Fit:
    """The largest micro-batch of ``recipe`` that fits ``budget``, and the global batch it gives.

    model      as for :func:`memfit.estimate`.
    batch      for a model without a config: an example batch (or a zero-argument callable); its
               tensors are grown along dim 0 to each size tried.
    gpu        a catalog GPU (``"rtx-4090"``): CUDA semantics, and its memory as the budget.
    budget     bytes or a size like ``"24GiB"`` (default: the ``gpu``'s memory).
    recipe     the techniques (``memfit.Recipe``); its ``micro_batch_size`` is what is searched,
               its ``grad_accum_steps`` is kept. ``precision``/``optimizer``: shorthands.
    device     ``"cuda"`` (default; ``h100-sxm`` semantics when only ``budget`` is given) or ``"cpu"``.
    progress   ``progress(done, total)`` as traces and estimates complete (total may grow).
    cache      a ``memfit.planner.cache.EngineCache`` shared with other ``plan``/``fit`` calls of the
               same config: its traces and full estimates are reused; default: made afresh.

    gpus, nodes  a data-parallel run (``recipe.parallel`` ddp or fsdp): the answer is the largest per-rank
               micro-batch, each size a full per-rank estimate (``ranks.fit_ranks``).

    Raises ``NoBatchFits`` (a ``MemfitError``) when micro-batch 1 does not fit.
    """
    from memfit.techniques.accumulation import MAX_BATCH

    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_BATCH:
        raise MemfitError(f"limit must be an integer from 1 to {MAX_BATCH} (examples per micro-batch), got "
                          f"{shown(limit)}")
    if gpus is not None or nodes is not None:
        if device is not None and str(device).startswith("cpu"):
            raise MemfitError("gpus= and device='cpu' conflict: fit across GPUs follows CUDA semantics; drop one")
        return _fit_ranks(model, batch, gpu, budget, recipe, precision, optimizer, seq_len, loss_fn, limit, progress,
                          gpus, nodes)
    start = time.perf_counter()
    search = _Search(model, batch, gpu, budget, recipe, precision, optimizer, seq_len, loss_fn, device, limit,
                     progress, cache)
    predicted = search.predict_answer()
    n = search.verify_from(predicted or 1)
    search.finish()
    return search.result(n, predicted, time.perf_counter() - start)


class _Search:
    """The model, budget and recipe of one ``fit`` call, its predictions and its full estimates."""

    def __init__(self, model, batch, gpu, budget, recipe, precision, optimizer, seq_len, loss_fn, device, limit,
                 progress, cache=None):
        from memfit.estimator.estimate import check_args, resolve_target
        from memfit.hardware.gpus import target as default_target
        from memfit.models.source import resolve

        check_args(precision, 1, 1, seq_len)
        recipe, factory = recipe_from(recipe, precision, optimizer)
        if recipe.micro_batch_size is not None:
            raise MemfitError("fit searches micro_batch_size: leave it unset in the recipe")
        if factory is not None:
            raise MemfitError("fit takes the optimizer by name (adamw, adafactor, ...), not a callable")
        if not isinstance(limit, int) or limit < 1:
            raise MemfitError(f"limit must be a positive integer, got {limit!r}")
        device = device or "cuda"
        if gpu is not None and str(device).startswith("cpu"):
            raise MemfitError("gpu and device='cpu' conflict: drop one")
        cpu = str(device).startswith("cpu")
        self.target = resolve_target(device, gpu if gpu is not None or cpu else default_target("cuda").gpu)
        if budget is None:
            if gpu is None:
                raise MemfitError("fit needs a budget: pass budget='24GiB' or gpu='rtx-4090'")
            self.budget = self.target.memory_bytes
        else:
            self.budget = parse_size(budget)
        # on a GPU a budget is the process's share of the card, judged by the verdict as torch would
        # enforce it (``verdict.py``); without one, the whole card
        self.limit_budget = None if budget is None or self.target is None else self.budget
        self.source = resolve(model)
        recipe, _ = checkpoint_recipe(self.source, recipe)  # a quantised checkpoint: trained as estimate says
        if callable(batch):
            batch = batch()
        if batch is None and self.source.config is None:
            raise MemfitError(f"{self.source.name} has no config to make a batch from: pass batch= (an example "
                              "batch; fit grows it along dim 0)")
        if batch is not None and seq_len is not None:
            raise MemfitError("seq_len and batch conflict: the batch's shape sets the sequence; drop seq_len")
        self.example = batch
        if batch is not None:
            from memfit.techniques.step import batch_rows

            batch_rows(batch)  # a batch with no batch dimension is one line here, not mid-search
        if seq_len is None and self.source.config is not None:
            seq_len = self.source.default_seq_len()
        self.seq_len, self.loss_fn, self.limit, self.progress = seq_len, loss_fn, limit, progress
        self.recipe = recipe.replace(micro_batch_size=1)
        self.engine = None
        self.cache = cache
        self.traces = 0
        self.full: dict[int, object] = {}  # micro-batch -> full estimate
        self.notes: list[str] = []
        self._done = 0
        self._total = None

    # -- predictions ------------------------------------------------------------------------------
    def predict_answer(self) -> int | None:
        """The largest micro-batch whose composed prediction fits, or None without predictions."""
        r = self.recipe
        if r.attention != "auto" or r.offload_optimizer or r.compile:
            self.notes.append("attention / offload_optimizer / compile are outside the planner's traces: searched "
                              "by full estimates only")
            return None
        from memfit.planner.compose import Engine
        from memfit.planner.cost import Speed
        from memfit.estimator.estimate import DEFAULT_GPU, resolve_target
        from memfit.planner.cache import EngineCache

        batch = None if self.example is None else _grown(self.example, PROBE)()
        if self.target is None:
            # fit reads bytes, never times: the CPU's speed (seconds to measure) is not needed
            self.engine = Engine(self.source, batch, None, self.seq_len, self.loss_fn, r.optimizer, PROBE,
                                 self._traced, speed=Speed.from_gpu(resolve_target("cuda", DEFAULT_GPU)))
        else:
            cache = EngineCache() if self.cache is None else self.cache  # the caller's traces of this config, if any
            self.engine = cache.engine(self.source, batch, self.target, self.seq_len, self.loss_fn, r.optimizer,
                                       PROBE, self._traced)
        self.engine.prepare([r])
        self.traces = self.engine.traces
        if self.predicted_bytes(1) > self.budget:
            return 1  # the full estimate of 1 says whether anything fits
        lo, hi = 1, 2  # lo fits by prediction; find hi that does not, then bisect
        while hi <= self.limit and self.predicted_bytes(hi) <= self.budget:
            lo, hi = hi, hi * 2
        hi = min(hi, self.limit + 1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.predicted_bytes(mid) <= self.budget else (lo, mid)
        return lo

    def predicted_bytes(self, n: int) -> int:
        return self.engine.predict(self.recipe.replace(micro_batch_size=n)).device_bytes

    def _traced(self, done, total):
        self._done, self._total = done, total + 2  # and at least two full estimates
        self._report()

    def finish(self):
        if self.progress:
            done = self._done + len(self.full)
            self.progress(done, done)

    def _report(self):
        if self.progress:
            done = self._done + len(self.full)
            total = None if self._total is None else max(self._total, done + 1)
            self.progress(done, total)

    # -- full estimates ----------------------------------------------------------------------------
    def estimate(self, n: int):
        from memfit.estimator.estimate import estimate

        if n not in self.full:
            r = self.recipe.replace(micro_batch_size=n)
            if self.example is None and self.engine is not None:
                self.full[n] = self.engine.verify(r, self.limit_budget)  # kept by the engine for the next call
                self._report()
                return self.full[n]
            batch = None if self.example is None else _grown(self.example, n * r.grad_accum_steps)
            self.full[n] = estimate(self.source, batch, recipe=r, loss_fn=self.loss_fn, seq_len=self.seq_len,
                                    device="cpu" if self.target is None else "cuda", gpu=self.target,
                                    budget=self.limit_budget)
            self._report()
        return self.full[n]

    def fits(self, n: int) -> bool:
        """By the verdict on a GPU (``verdict.py``: what torch would do under the limit), by the peak on
        the CPU."""
        report = self.estimate(n)
        if report.verdict is not None:
            return report.verdict == FITS  # runs with torch's default allocator settings (retries allowed)
        return report.device_bytes <= self.budget

    def need(self, n: int) -> int:
        """What the step at ``n`` asks of the device: on out of memory, what was held plus what was
        missing (the figure capped at the limit would hide how far over it is)."""
        report = self.estimate(n)
        return report.device_bytes + ((report.missing_bytes or 0) if report.verdict == OOM else 0)

    def verify_from(self, guess: int) -> int:
        """The largest n that fits by a full estimate with n + 1 not fitting (or n = limit)."""
        lo, hi = 0, self.limit + 1  # lo fits, hi does not (by full estimates; the ends are bounds)
        n = max(1, min(guess, self.limit))
        while hi - lo > 1:
            if self.fits(n):
                lo = n
            else:
                hi = n
            if hi - lo <= 1:
                break
            n = self._next_guess(n, lo, hi)
        if lo == 0:
            raise self._nothing_fits()
        return lo

    def _next_guess(self, n: int, lo: int, hi: int) -> int:
        """Where to look next: where a line through the full estimates crosses the budget (a
        secant), clamped to the sizes not yet settled; bisection once secants keep missing."""
        guess = self._secant(n, lo, hi) if len(self.full) <= 4 else None
        if guess is None:
            guess = lo * 2 if hi > self.limit else (lo + hi) // 2
        return max(lo + 1, min(hi - 1, self.limit, guess))

    def _secant(self, n: int, lo: int, hi: int) -> int | None:
        if lo in self.full and hi in self.full:  # the line through the two sizes either side
            x, y = lo, self.need(lo)
            slope = (self.need(hi) - y) / (hi - lo)
        elif self.engine is not None:  # the prediction's slope, through the estimate at n
            x, y = n, self.need(n)
            slope = self.predicted_bytes(n + 1) - self.predicted_bytes(n)
        else:
            return None
        return None if slope <= 0 else int(x + (self.budget - y) // slope)

    def _nothing_fits(self) -> NoBatchFits:
        from memfit.hardware.gpus import CATALOG

        needed = self.need(1)
        where = f"--gpu {self.target.name}" if self.target is not None else f"--device cpu --budget {self.budget}"
        if self.seq_len and self.source.config is not None:
            where += f" --seq-len {self.seq_len}"
        fixes = [f"the techniques plan picks (memfit plan {self.source.name} {where} --allow lora,qlora,adamw8bit)"]
        if self.seq_len and self.source.config is not None and self.source.task != "image-classification":
            fixes.append(f"a shorter sequence than {self.seq_len}")
        if self.target is not None:
            bigger = sorted((g for g in CATALOG.values() if g.memory_bytes >= needed), key=lambda g: g.memory_bytes)
            if bigger:
                fixes.append(f"a bigger card ({bigger[0].name}, {format_size(bigger[0].memory_bytes)})")
        recipe = self.recipe.replace(micro_batch_size=None).describe()
        return NoBatchFits(f"nothing fits {format_size(self.budget)}: micro-batch 1 ({recipe}) needs "
                           f"{format_size(needed)}; try " + ", or ".join(fixes), needed, self.budget)

    # -- the answer --------------------------------------------------------------------------------
    def result(self, n: int, predicted: int | None, seconds: float) -> Fit:
        report = self.estimate(n)
        above = self.full.get(n + 1)
        notes = list(self.notes)
        if predicted is not None and predicted != n:
            notes.append(f"the composed prediction said {predicted}; full estimates moved it to {n}")
        if above is None:
            notes.append(f"the search stops at micro-batch {self.limit} (limit=)")
        return Fit(recipe=self.recipe.replace(micro_batch_size=n), micro_batch_size=n,
                   grad_accum_steps=self.recipe.grad_accum_steps, budget_bytes=self.budget,
                   device_bytes=report.device_bytes, allocated_bytes=report.peak_bytes,
                   reserved_bytes=report.reserved_bytes, next_bytes=None if above is None else self.need(n + 1),
                   predicted_micro_batch_size=predicted, tokens_per_example=self._tokens_per_example(),
                   estimates=len(self.full), traces=self.traces,
                   seconds=seconds, device="cpu" if self.target is None else "cuda",
                   gpu=None if self.target is None else self.target.name, model=self.source.name, report=report,
                   notes=tuple(notes))

    def _tokens_per_example(self) -> int | None:
        if self.example is None:
            if self.source.task == "image-classification" or not self.seq_len:
                return None
            return self.seq_len
        from memfit.techniques.step import batch_tensors

        first = batch_tensors(self.example)[0]  # token ids: a 2-D integer tensor (rows x sequence)
        return first.shape[1] if first.dim() == 2 and not first.is_floating_point() else None


def _fit_ranks(model, batch, gpu, budget, recipe, precision, optimizer, seq_len, loss_fn, limit, progress, gpus, nodes):
    from memfit.estimator.estimate import DEFAULT_GPU, resolve_target
    from memfit.hardware.cluster import world_of
    from memfit.models.source import resolve

    world = world_of(gpus, nodes)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise MemfitError(f"limit must be a positive integer, got {limit!r}")
    recipe, factory = recipe_from(recipe, precision, optimizer)
    if factory is not None:
        raise MemfitError("fit across GPUs takes the optimizer by name (the recipe's); drop the optimizer callable")
    if recipe.micro_batch_size is not None:
        raise MemfitError("fit searches the micro-batch size: drop micro_batch_size from the recipe")
    if recipe.parallel == "none":
        raise MemfitError(f"gpus={gpus} needs parallel=ddp or parallel=fsdp in the recipe (--parallel fsdp)")
    if batch is not None:
        raise MemfitError("fit across GPUs grows a catalog or config model's batch: drop batch= (or gpus=)")
    target = resolve_target("cuda", gpu or DEFAULT_GPU)
    budget_bytes = target.memory_bytes if budget is None else parse_size(budget)
    source = resolve(model)
    recipe, _ = checkpoint_recipe(source, recipe)
    if seq_len is None and source.config is not None:
        seq_len = source.default_seq_len()
    return fit_ranks(source, target=target, budget_bytes=budget_bytes, recipe=recipe, world=world, seq_len=seq_len,
                     loss_fn=loss_fn, limit=limit, progress=progress)


def fit_ranks(source, *, target, budget_bytes: int, recipe: Recipe, world: World, seq_len, loss_fn=None,
              limit: int = 65536, progress=None):
    """``fit`` for one rank of ``world``: the largest per-rank micro-batch of ``recipe`` (its
    ``grad_accum_steps`` kept) whose per-rank estimate fits ``budget_bytes``: doubling, then
    bisection, every size a full per-rank estimate (memory grows with the micro-batch)."""
    from memfit.estimator.estimate import estimate

    start = time.perf_counter()
    accum, seen = recipe.grad_accum_steps, {}

    def check(micro: int):
        if micro not in seen:
            seen[micro] = estimate(source, recipe=recipe.replace(micro_batch_size=micro), seq_len=seq_len,
                                   batch_size=micro * accum * world.size, gpu=target, budget=budget_bytes,
                                   gpus=world.gpus, nodes=world.nodes, loss_fn=loss_fn)
            if progress is not None:
                progress(len(seen), len(seen) + 1)
        return seen[micro].verdict != OOM

    if not check(1):
        one = seen[1]
        raise NoBatchFits(f"micro-batch 1 of {recipe.describe()} does not fit {world.describe()} x {target.name}: "
                          f"{format_size(one.device_bytes + (one.missing_bytes or 0))} per rank of "
                          f"{format_size(budget_bytes)}; memfit plan --gpus {world.gpus}"
                          + (f" --nodes {world.nodes}" if world.nodes > 1 else "") + " finds a recipe that does",
                          one.device_bytes + (one.missing_bytes or 0), budget_bytes)
    low = 1
    while low * 2 <= limit and check(low * 2):
        low *= 2
    high = min(low * 2, limit + 1)  # does not fit (or past the limit)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if check(middle) else (low, middle)
    report, above = seen[low], seen.get(low + 1)
    notes = [f"per rank of {world.describe()} ({recipe.parallel}): the global batch is micro-batch x "
             f"{accum} accumulation x {world.size} ranks"]
    if above is None:
        notes.append(f"the search stops at micro-batch {limit} (limit=)")
    return Fit(recipe=recipe.replace(micro_batch_size=low), micro_batch_size=low, grad_accum_steps=accum,
               budget_bytes=budget_bytes, device_bytes=report.device_bytes, allocated_bytes=report.peak_bytes,
               reserved_bytes=report.reserved_bytes,
               next_bytes=None if above is None else above.device_bytes + (above.missing_bytes or 0),
               predicted_micro_batch_size=None, tokens_per_example=seq_len, estimates=len(seen), traces=0,
               seconds=time.perf_counter() - start, device="cuda", gpu=target.name, model=source.name, report=report,
               notes=tuple(notes), ranks=world.size)


def _grown(batch, rows: int):
    """A zero-argument callable making ``batch`` with ``rows`` rows: each tensor's shape past dim 0
    and its dtype, filled with zeros (called inside a fake mode it makes fake tensors)."""
    from torch.utils._pytree import tree_map

    def make():
        return tree_map(lambda t: torch.zeros((rows, *t.shape[1:]), dtype=t.dtype)
                        if isinstance(t, torch.Tensor) and t.dim() else t, batch)

    return make
