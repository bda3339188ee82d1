"""``fit`` across data-parallel ranks: the largest per-rank micro-batch of a DDP / FSDP2 recipe.

Unlike ``fit`` on one device there are no composed predictions to search first: every size tried is a
full per-rank estimate under PyTorch's fake process group (``estimator/sharded.py``), found by doubling
and then bisection, since memory grows with the micro-batch.
"""

from __future__ import annotations

import time

from memfit.errors import MemfitError
from memfit.estimator.checkpoint import checkpoint_recipe
from memfit.estimator.inputs import Data, Hardware
from memfit.estimator.verdict import runs
from memfit.hardware.cluster import World
from memfit.planner.fit_result import Fit, NoBatchFits
from memfit.techniques.recipe import Recipe, recipe_from
from memfit.units import format_size

__all__ = ["fit_across", "fit_ranks"]

def fit_across(model, batch, hardware, recipe, precision, optimizer, seq_len, loss_fn, limit, progress) -> Fit:
    """``fit``'s checks of a call with ``hardware.gpus`` (its recipe, its batch), then ``fit_ranks``."""
    from memfit.estimator.checks import resolve_target
    from memfit.hardware.cluster import world_of
    from memfit.hardware.gpus import DEFAULT_GPU
    from memfit.models.source import resolve

    if hardware.on_cpu:
        raise MemfitError("gpus= and device='cpu' conflict: fit across GPUs follows CUDA semantics; drop one")
    world, gpus = world_of(hardware.gpus, hardware.nodes), hardware.gpus
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
    target = resolve_target("cuda", hardware.gpu or DEFAULT_GPU)
    budget_bytes = (target.working_set_bytes or target.memory_bytes) if hardware.budget is None else hardware.budget
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
    where = Hardware(gpu=target, budget=budget_bytes, gpus=world.gpus, nodes=world.nodes)

    def check(micro: int):
        if micro not in seen:
            seen[micro] = estimate(source, recipe=recipe.replace(micro_batch_size=micro), hardware=where,
                                   data=Data(batch_size=micro * accum * world.size, seq_len=seq_len), loss_fn=loss_fn)
            if progress is not None:
                progress(len(seen), len(seen) + 1)
        return runs(seen[micro].verdict)

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

