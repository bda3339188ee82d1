"""Before a run commits to a plan: time the few most promising recipes on the device it runs on.

``plan`` ranks recipes by a cost model (roofline per kernel on a GPU, measured rates on the CPU). It
ranks far apart recipes well, but two close ones can swap on a given machine: on 2 CPU cores a small
Llama ran fp32 at 1.3x the tokens/s of bf16 autocast, which the model put the other way round
(``bench/training/train_speed.py``). So ``calibrate`` takes the fastest predicted plan of each distinct set of
techniques (precision, checkpointing, chunked loss, optimizer step...: the micro-batch is ``train``'s
own to size), at most ``most`` of them and covering each precision and checkpointing level first, then each
pair of the two (on 2 CPU cores a small Llama without checkpointing at half the micro-batch ran 1.3x the
tokens/s of the full micro-batch with checkpointing, which the model also put the other way round: neither
fp32 nor "no checkpointing" alone reached that plan), builds a fresh model for each, runs ``steps`` optimizer steps of
the plan's global batch of full-length rows under the run's budget (the virtual budget on the CPU, the
memory fraction on CUDA), and keeps the fastest measured (the plan's own choice unless another is at
least ``MARGIN`` faster); one that runs out of memory is passed over.
It stops at ``seconds`` of wall time (always after the first candidate), and never chooses a recipe it
did not time over the predicted best.

Why by hand: no library times training recipes against each other; the steps themselves are memfit's
``apply`` step, the one ``train`` runs.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import time
from dataclasses import dataclass, field

import torch

from memfit.techniques.recipe import Recipe

__all__ = ["calibrate", "Calibration", "candidates"]

#: recipes timed at most, and the wall time calibration may take in all (issue 34: <= 20 s; where one step
#: takes seconds, the time stops it before ``MOST`` does)
MOST, SECONDS = 6, 20.0
#: how much faster than the plan's own choice a timed recipe must be to replace it
MARGIN = 0.05


@dataclass
class Calibration:
    """The recipe chosen and what was timed: one row per candidate (recipe, predicted and measured step
    seconds, or why it was not measured)."""

    recipe: Recipe
    predicted_step_seconds: float | None
    measured_step_seconds: float | None
    rows: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"recipe": self.recipe.describe(), "predicted_step_seconds": self.predicted_step_seconds,
                "measured_step_seconds": self.measured_step_seconds, "rows": self.rows,
                "seconds": round(self.seconds, 1)}


def _techniques(recipe: Recipe) -> Recipe:
    return recipe.replace(micro_batch_size=None, grad_accum_steps=1)


#: fields whose every value among the plans gets its fastest candidate timed before the rest: where
#: a cost model errs, it errs by kind (bf16 autocast against fp32 on a small CPU model; recomputation)
SPREAD = ("precision", "checkpointing", "optimizer_in_backward", "chunked_loss")
#: after each value alone, each pair of values of these two: where the model errs on both at once
PAIRED = ("precision", "checkpointing")


def _kind(recipe: Recipe, name: str):
    """A SPREAD field's value as a kind: every ``blocks:N`` is one kind of checkpointing."""
    value = getattr(recipe, name)
    return value.split(":")[0] if name == "checkpointing" else value


def candidates(plans, most: int = MOST) -> list:
    """Up to ``most`` plans to time, fastest predicted first: the fastest of each distinct set of
    techniques, chosen to cover first the plans' first (the verified choice), then each value of the
    ``SPREAD`` fields in turn (so fp32 is timed beside a faster-predicted bf16), then each pair of ``PAIRED``
    values (fp32 without checkpointing beside bf16 without and fp32 with), then the next fastest."""
    distinct, seen = [], set()
    for p in plans:
        key = _techniques(p.recipe)
        if key not in seen:
            seen.add(key)
            distinct.append(p)
    chosen = distinct[:1]
    for name in SPREAD:
        for p in distinct:
            if len(chosen) >= most:
                break
            if _kind(p.recipe, name) not in {_kind(q.recipe, name) for q in chosen}:
                chosen.append(p)
    for p in distinct:
        if len(chosen) >= most:
            break
        pair = tuple(_kind(p.recipe, name) for name in PAIRED)
        if pair not in {tuple(_kind(q.recipe, name) for name in PAIRED) for q in chosen}:
            chosen.append(p)
    for p in distinct:
        if len(chosen) >= most:
            break
        if p not in chosen:
            chosen.append(p)
    order = {id(p): i for i, p in enumerate(distinct)}
    return sorted(chosen, key=lambda p: order[id(p)])


@contextlib.contextmanager
def _capped(device: torch.device, budget: int | None, model):
    if budget is None:
        yield
        return
    if device.type == "cpu":
        from memfit.accounting.budget import VirtualBudget

        resident = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
        with VirtualBudget(budget, resident=resident):
            yield
        return
    index = device.index if device.index is not None else torch.cuda.current_device()  # the call wants an index
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), index)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)


def _time(build, recipe: Recipe, batch: dict, device: torch.device, budget: int | None, steps: int) -> float:
    """Seconds of the fastest of ``steps`` optimizer steps but the first, of ``recipe`` on a fresh model (raises
    ``torch.OutOfMemoryError`` past the budget)."""
    from memfit.techniques.apply import apply
    from memfit.techniques.optimizer_in_backward import InBackward

    torch.manual_seed(0)
    model = opt = step = None
    try:
        with torch.device(device):  # initialised where it runs: a 1B model's random init takes seconds on a CPU
            model = build().to(device)
        with _capped(device, budget, model):
            _, opt, step = apply(model, recipe)
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                step(batch)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - start)
            seconds = min(times[1:] or times)  # past the first (warm-up); the least disturbed of the rest
        return seconds
    finally:
        # everything of the timed model goes before the run's own model is built: its optimizer state,
        # the step's closures (cycles: collected), and the allocator's cached blocks, or the run starts
        # beside the leftovers, split into the timed run's segments (measured on an H200: a 1B model's run
        # planned at 23.7 of 24 GiB ran out of memory after its calibration, and fitted without one)
        if isinstance(opt, InBackward):
            opt.remove()
        del model, opt, step
        _release(device)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def calibrate(plans, build, batch: dict, *, device, budget: int | None = None, gpu=None, most: int = MOST,
              seconds: float = SECONDS, steps: int = 4, log=None) -> Calibration:
    """Time ``candidates(plans, most)`` (``build()``: a fresh model; ``batch``: the global batch, dim 0
    split as each recipe says) and return the fastest measured; see the module docstring. On CUDA ``budget``
    is the process's (its CUDA context included, as ``plan`` counts it) and ``gpu`` the catalog card whose
    context that is (default: the one torch sees); the allocator gets ``gpu.allowed_bytes(budget)``."""
    device = torch.device(device)
    if device.type == "cuda" and budget is not None:
        from memfit.hardware.gpus import gpu as catalog_gpu, target

        card = target("cuda", None).gpu if gpu is None else catalog_gpu(gpu) if isinstance(gpu, str) else gpu
        budget = card.allowed_bytes(budget)  # from here on, the limit of torch's allocator
    batch = {k: v.to(device) for k, v in batch.items()}
    start, rows, best, first = time.perf_counter(), [], None, plans[0]
    for i, plan in enumerate(candidates(plans, most)):
        if i and time.perf_counter() - start > seconds:
            rows.append({"recipe": plan.recipe.describe(), "predicted_step_seconds": plan.step_seconds,
                         "measured_step_seconds": None, "why": f"not timed: calibration's {seconds:.0f} s were spent"})
            continue
        try:
            measured = _time(build, plan.recipe, batch, device, budget, steps)
            why = None
        except torch.OutOfMemoryError:
            measured, why = None, "out of memory within the budget"
        if measured is None:
            _release(device)  # what the error's frames held
        rows.append({"recipe": plan.recipe.describe(), "predicted_step_seconds": plan.step_seconds,
                     "measured_step_seconds": measured, **({"why": why} if why else {})})
        if log is not None:
            log(rows[-1])
        if measured is None:
            continue
        # the plan's own choice (timed first) is left only for one measurably faster: two timings of
        # near-equal recipes differ by more than that on shared cores
        if best is None or measured < best[1] * (1 - MARGIN if best[0] is first else 1):
            best = (plan, measured)
    if best is None:  # nothing ran: the verified choice, untimed
        first = plans[0]
        return Calibration(first.recipe, first.step_seconds, None, rows, time.perf_counter() - start)
    return Calibration(best[0].recipe, best[0].step_seconds, best[1], rows, time.perf_counter() - start)
