"""``longest``: the longest sequence a recipe fits in a budget, at a given micro-batch (one row by default).

The question long-context fine-tuning asks ("how many tokens fit on my 24 GB card?"), the one Unsloth's
maximum-context tables answer. ``fit`` searches the micro-batch at a fixed length; this searches the length at a
fixed micro-batch, each length a full ``estimate`` of the config model's step with a batch of that many tokens
(on the depth fast path where the model has one). The search halves from ``START`` tokens until a length fits, or
doubles until one does not, then moves along the line through the full estimates either side of the edge (a
secant), bisecting once secants keep missing, until a length fits and the next one (``multiple`` tokens more) does
not. A step's memory grows with its length (linearly with flash or memory-efficient attention, quadratically with
eager attention's scores), so the edge is where the estimates cross the budget; "fits" is ``fit``'s criterion (the
verdict on a GPU: what torch would do under the card's limit; the peak on the CPU). Lengths past the model's
``max_position_embeddings`` are searched like any other (memory does not care; a note says the model may).
Written by hand: no library searches a step's length against a memory budget.

Left out: models without a config (a factory's batch is the user's; estimate it at the lengths wanted), vision
models (no sequence), several GPUs (context parallel splits a sequence: ``plan --gpus``), packed or ragged rows
(one length, padded).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from memfit.errors import MemfitError, shown
from memfit.estimator.inputs import Data, Hardware, gather
from memfit.estimator.verdict import FITS, OOM
from memfit.techniques.recipe import Recipe, recipe_from
from memfit.units import format_size

__all__ = ["longest", "Longest", "NoLengthFits", "LIMIT"]

LIMIT = 1 << 20  # the longest sequence searched, in tokens
START = 1024  # the first length tried (halved while it does not fit)


class NoLengthFits(MemfitError):
    """Not even ``multiple`` tokens fit: ``needed_bytes`` is what the shortest length asks."""

    def __init__(self, message: str, needed_bytes: int, budget_bytes: int):
        super().__init__(message)
        self.needed_bytes, self.budget_bytes = needed_bytes, budget_bytes


@dataclass(frozen=True)
class Longest:
    """The longest sequence (``seq_len`` tokens a row, ``micro_batch_size`` rows) of ``recipe`` that fits
    ``budget_bytes`` by a full estimate, with ``seq_len + multiple`` not fitting (``next_bytes`` what that asks;
    None when the search stopped at ``LIMIT``)."""

    seq_len: int
    micro_batch_size: int
    multiple: int
    recipe: Recipe
    budget_bytes: int
    device_bytes: int
    allocated_bytes: int
    reserved_bytes: int | None
    next_bytes: int | None
    estimates: int
    seconds: float
    device: str
    gpu: str | None
    model: str
    report: object = field(repr=False, compare=False, default=None)
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {"fits": True, "model": self.model, "device": self.device, "gpu": self.gpu,
                "seq_len": self.seq_len, "micro_batch_size": self.micro_batch_size, "multiple": self.multiple,
                "tokens_per_micro_batch": self.seq_len * self.micro_batch_size, "budget_bytes": self.budget_bytes,
                "device_bytes": self.device_bytes, "allocated_bytes": self.allocated_bytes,
                "reserved_bytes": self.reserved_bytes, "next_bytes": self.next_bytes,
                "recipe": self.recipe.to_dict(), "estimates": self.estimates, "seconds": round(self.seconds, 2),
                "notes": list(self.notes)}


def longest(model, *, hardware: Hardware | None = None, recipe: Recipe | None = None, precision: str = "fp32",
            optimizer: str = "adamw", loss_fn=None, micro_batch_size: int = 1, multiple: int = 1,
            limit: int = LIMIT, progress=None, gpu=None, budget=None, device: str | None = None) -> Longest:
    """The longest sequence of ``recipe`` at ``micro_batch_size`` rows that fits the budget.

        memfit.longest("llama-3.1-8b", gpu="a100-80gb", recipe=memfit.Recipe(lora="qlora:32",
                       precision="bf16-mixed", checkpointing="blocks"))

    model      a catalog name, a config (path or object) or a Hub id: a model whose batch memfit makes.
    hardware   a :class:`memfit.Hardware` (or ``gpu``, ``budget``, ``device``): as for :func:`memfit.fit`.
    multiple   the lengths searched are multiples of it (8 or 64 for kernels that want them; default 1).
    limit      the longest length searched (default 1,048,576 tokens).
    progress   ``progress(done, total)`` as full estimates complete (total unknown: None).

    Raises ``NoLengthFits`` (a ``MemfitError``) when ``multiple`` tokens do not fit.
    """
    from memfit.models.source import resolve

    hardware, _ = gather(hardware, None, gpu=gpu, budget=budget, device=device)
    for name, value in (("micro_batch_size", micro_batch_size), ("multiple", multiple), ("limit", limit)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise MemfitError(f"{name} must be a positive integer, got {shown(value)}")
    if limit < multiple:
        raise MemfitError(f"limit={limit} is shorter than multiple={multiple}: nothing to search")
    if hardware.gpus is not None or hardware.nodes is not None:
        raise MemfitError("longest searches one device: across GPUs a sequence splits by context parallel (memfit "
                          "plan --gpus N searches it)")
    source = resolve(model)
    if source.config is None:
        raise MemfitError(f"{source.name} has no config: longest makes the batch at each length, which a factory "
                          "model's batch does not let it do; estimate your batch at the lengths you want")
    if source.task == "image-classification":
        raise MemfitError(f"{source.name} reads images, not sequences: use memfit fit for its batch size")
    search = _Search(source, hardware, recipe, precision, optimizer, loss_fn, micro_batch_size, multiple, limit,
                     progress)
    start = time.perf_counter()
    k = search.edge()
    return search.result(k, time.perf_counter() - start)


class _Search:
    """One ``longest`` call: lengths in units of ``multiple`` tokens, and their full estimates."""

    def __init__(self, source, hardware, recipe, precision, optimizer, loss_fn, rows, multiple, limit, progress):
        from memfit.planner.fit import card_and_budget

        recipe, factory = recipe_from(recipe, precision, optimizer)
        if factory is not None:
            raise MemfitError("longest takes the optimizer by name (adamw, adafactor, ...), not a callable")
        if recipe.micro_batch_size is not None:
            raise MemfitError("longest takes the rows as micro_batch_size=, not in the recipe")
        self.target, self.budget, self.limit_budget = card_and_budget(hardware, "longest")
        self.source, self.loss_fn, self.rows, self.multiple, self.progress = source, loss_fn, rows, multiple, progress
        self.top = limit // multiple  # the most units searched
        self.recipe = recipe.replace(micro_batch_size=rows)
        self.full: dict[int, object] = {}  # units -> full estimate

    def estimate(self, k: int):
        from memfit.estimator.estimate import estimate

        if k not in self.full:
            where = Hardware(device="cpu" if self.target is None else "cuda", gpu=self.target, budget=self.limit_budget)
            self.full[k] = estimate(self.source, None, recipe=self.recipe, loss_fn=self.loss_fn, hardware=where,
                                    data=Data(batch_size=self.rows * self.recipe.grad_accum_steps,
                                              seq_len=k * self.multiple))
            if self.progress:
                self.progress(len(self.full), None)
        return self.full[k]

    def fits(self, k: int) -> bool:
        report = self.estimate(k)
        if report.verdict is not None:
            return report.verdict == FITS
        return report.device_bytes <= self.budget

    def need(self, k: int) -> int:
        report = self.estimate(k)
        return report.device_bytes + ((report.missing_bytes or 0) if report.verdict == OOM else 0)

    def edge(self) -> int:
        """The most units that fit with one more not fitting (or ``top``)."""
        k = max(1, min(self.top, START // self.multiple))
        while not self.fits(k):  # halve down to a length that fits
            if k == 1:
                raise self._nothing_fits()
            k //= 2
        lo, hi = k, self.top + 1  # lo fits, hi does not (the ends are bounds)
        while hi - lo > 1:
            k = self._next(lo, hi)
            if self.fits(k):
                lo = k
            else:
                hi = k
        return lo

    def _next(self, lo: int, hi: int) -> int:
        """A secant through the full estimates either side of the edge (or through the last two that fit while
        none has failed), bisection once secants keep missing; doubling while nothing above has been tried."""
        guess = None
        if len(self.full) <= 8:
            fitted = sorted(k for k in self.full if k <= lo)
            a, b = (lo, hi) if hi in self.full else (fitted[-2], lo) if len(fitted) > 1 else (None, None)
            if a is not None:
                slope = (self.need(b) - self.need(a)) / (b - a)
                if slope > 0:
                    guess = int(a + (self.budget - self.need(a)) // slope)
                    if hi not in self.full:
                        guess = min(guess, 2 * lo)  # not past one doubling on a line drawn below the edge
        if guess is None:
            guess = 2 * lo if hi > self.top else (lo + hi) // 2
        return max(lo + 1, min(hi - 1, guess))

    def _nothing_fits(self) -> NoLengthFits:
        needed = self.need(1)
        recipe = self.recipe.replace(micro_batch_size=None).describe()
        return NoLengthFits(f"nothing fits {format_size(self.budget)}: {self.multiple} token(s) x {self.rows} row(s) "
                            f"({recipe}) need {format_size(needed)}; try the techniques plan picks (memfit plan "
                            f"{self.source.name} --allow lora,qlora,adamw8bit) or a bigger card", needed, self.budget)

    def result(self, k: int, seconds: float) -> Longest:
        report = self.estimate(k)
        above = k + 1 if k + 1 in self.full else None
        notes = [] if above is not None else [f"the search stops at {self.top * self.multiple} tokens (limit=)"]
        positions = getattr(self.source.config, "max_position_embeddings", None)
        if positions and k * self.multiple > positions:
            notes.append(f"past the model's max_position_embeddings ({positions}): memory is estimated as for any "
                         "length; whether the model works there is another question")
        return Longest(seq_len=k * self.multiple, micro_batch_size=self.rows, multiple=self.multiple,
                       recipe=self.recipe, budget_bytes=self.budget, device_bytes=report.device_bytes,
                       allocated_bytes=report.peak_bytes, reserved_bytes=report.reserved_bytes,
                       next_bytes=None if above is None else self.need(above), estimates=len(self.full),
                       seconds=seconds, device="cpu" if self.target is None else "cuda",
                       gpu=None if self.target is None else self.target.name, model=self.source.name, report=report,
                       notes=tuple(notes))
