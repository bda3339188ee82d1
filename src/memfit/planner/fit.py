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

The answer, ``Fit`` (and ``NoBatchFits``), is in ``fit_result.py``; the search across data-parallel ranks in
``fit_ranks.py``.

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

import torch

from memfit.errors import MemfitError, shown
from memfit.estimator.checkpoint import checkpoint_recipe
from memfit.estimator.inputs import Data, Hardware, gather
from memfit.estimator.verdict import FITS, OOM
from memfit.planner.fit_result import Fit, NoBatchFits, edge_note
from memfit.techniques.recipe import Recipe, recipe_from
from memfit.units import format_size

__all__ = ["fit", "Fit", "NoBatchFits", "LIMIT", "card_and_budget"]

LIMIT = 65536  # the largest micro-batch searched
PROBE = 4  # without a prime-size trace: the second batch size traced (the first is 2)


def fit(model, batch=None, *, hardware: Hardware | None = None, data: Data | None = None,
        recipe: Recipe | None = None, precision: str = "fp32", optimizer: str = "adamw", loss_fn=None,
        limit: int = LIMIT, progress=None, cache=None, gpu=None, budget=None, seq_len: int | None = None,
        device: str | None = None, gpus: int | None = None, nodes: int | None = None) -> Fit:
    """The largest micro-batch of ``recipe`` that fits ``budget``, and the global batch it gives.

        memfit.fit("llama-3.2-1b", hardware=memfit.Hardware(gpu="rtx-4090"), data=memfit.Data(seq_len=2048))

    model      as for :func:`memfit.estimate`.
    hardware   a :class:`memfit.Hardware`: ``gpu``, ``budget``, ``device``, ``gpus`` and ``nodes`` below
               (each also a keyword of that name).
    data       a :class:`memfit.Data` with ``seq_len`` (also a keyword): the batch size is what fit searches.
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
               micro-batch, each size a full per-rank estimate (``fit_ranks.py``).

    Raises ``NoBatchFits`` (a ``MemfitError``) when micro-batch 1 does not fit.
    """
    from memfit.techniques.accumulation import MAX_BATCH

    hardware, data = gather(hardware, data, gpu=gpu, budget=budget, device=device, gpus=gpus, nodes=nodes,
                            seq_len=seq_len)
    if data.batch_size is not None or data.lengths is not None or data.packed:
        raise MemfitError("fit searches the batch size of fixed-length rows: give data=Data(seq_len=...) without "
                          "batch_size, lengths or packed")
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_BATCH:
        raise MemfitError(f"limit must be an integer from 1 to {MAX_BATCH} (examples per micro-batch), got "
                          f"{shown(limit)}")
    if hardware.gpus is not None or hardware.nodes is not None:
        from memfit.planner.fit_ranks import fit_across

        return fit_across(model, batch, hardware, recipe, precision, optimizer, data.seq_len, loss_fn, limit, progress)
    start = time.perf_counter()
    search = _Search(model, batch, hardware, recipe, precision, optimizer, data.seq_len, loss_fn, limit, progress,
                     cache)
    predicted = search.predict_answer()
    n = search.verify_from(predicted or 1)
    search.finish()
    return search.result(n, predicted, time.perf_counter() - start)


def card_and_budget(hardware: Hardware, who: str):
    """(the target card, or None on the CPU; the budget in bytes; the budget the verdict enforces, or None for the
    whole card) of a search's ``hardware`` (``fit``'s and ``longest``'s)."""
    from memfit.estimator.checks import resolve_target
    from memfit.hardware.gpus import target as default_target

    gpu, budget, cpu = hardware.gpu, hardware.budget, hardware.on_cpu  # (a gpu on the cpu: Hardware refused it)
    target = resolve_target(hardware.device or "cuda", gpu if gpu is not None or cpu else default_target("cuda").gpu)
    if budget is None:
        if gpu is None:
            raise MemfitError(f"{who} needs a budget: pass budget='24GiB' or gpu='rtx-4090'")
        # a Mac: the working set macOS gives its GPU (past it the step swaps: ``estimator/mps_fit.py``)
        budget = target.working_set_bytes or target.memory_bytes
        return target, budget, None
    # on a GPU a budget is the process's share of the card, judged by the verdict as torch would enforce it
    # (``verdict.py``); without one, the whole card
    return target, budget, None if target is None else budget


class _Search:
    """The model, budget and recipe of one ``fit`` call, its predictions and its full estimates."""

    def __init__(self, model, batch, hardware: Hardware, recipe, precision, optimizer, seq_len, loss_fn, limit,
                 progress, cache=None):
        from memfit.estimator.checks import check_args
        from memfit.models.source import resolve

        check_args(precision, 1)
        recipe, factory = recipe_from(recipe, precision, optimizer)
        if recipe.micro_batch_size is not None:
            raise MemfitError("fit searches micro_batch_size: leave it unset in the recipe")
        if factory is not None:
            raise MemfitError("fit takes the optimizer by name (adamw, adafactor, ...), not a callable")
        if not isinstance(limit, int) or limit < 1:
            raise MemfitError(f"limit must be a positive integer, got {limit!r}")
        self.target, self.budget, self.limit_budget = card_and_budget(hardware, "fit")
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
        from memfit.estimator.checks import resolve_target
        from memfit.hardware.gpus import DEFAULT_GPU
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
            where = Hardware(device="cpu" if self.target is None else "cuda", gpu=self.target,
                             budget=self.limit_budget)
            self.full[n] = estimate(self.source, batch, recipe=r, loss_fn=self.loss_fn, hardware=where,
                                    data=Data(seq_len=self.seq_len))
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
            bigger = sorted((g for g in CATALOG.values() if g.memory_bytes >= needed and g.vendor == self.target.vendor),
                            key=lambda g: g.memory_bytes)
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
        if self.target is not None:
            notes += edge_note(n, self.budget, report.device_bytes, None if above is None else self.need(n + 1))
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


def _grown(batch, rows: int):
    """A zero-argument callable making ``batch`` with ``rows`` rows: each tensor's shape past dim 0
    and its dtype, filled with zeros (called inside a fake mode it makes fake tensors)."""
    from torch.utils._pytree import tree_map

    def make():
        return tree_map(lambda t: torch.zeros((rows, *t.shape[1:]), dtype=t.dtype)
                        if isinstance(t, torch.Tensor) and t.dim() else t, batch)

    return make
