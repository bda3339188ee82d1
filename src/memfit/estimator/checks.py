"""The checks an estimate makes of its arguments before it traces anything, and where it runs.

Every wrong argument is one line naming the fix, raised here before the first fake tensor is made:
counts (steps, batch size, sequence length) and their bounds, switches that must be True/False or a
callable, the workload and what it excludes, a ``device_map`` placement request, the world of a
multi-rank run, the card whose semantics are followed, the budget under it, and the rule that ties
``batch_size`` to a recipe's micro-batches and ranks (``step_batch``).

Left out: checks that need the model (its blocks, its config) stay with the code that builds it.
"""

from __future__ import annotations

from memfit.errors import MemfitError, shown
from memfit.hardware.gpus import DEFAULT_GPU
from memfit.techniques.accumulation import MAX_ACCUM_STEPS
from memfit.techniques.precision import check_precision
from memfit.techniques.recipe import Recipe

__all__ = ["MAX_STEPS", "MAX_SEQ", "check_count", "check_args", "check_switches", "check_workload", "placement_request",
           "recipe_world", "resolve_target", "budget_bytes", "step_batch"]

# Bounds past which a trace would run for hours (steps) or byte counts overflow 64 bits.
MAX_STEPS = 64
MAX_SEQ = 1 << 24


def check_count(name: str, value, limit: int) -> None:
    """``value`` an integer from 1 to ``limit`` (a bool is not one), else one line naming the range."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= limit:
        raise MemfitError(f"{name} must be an integer from 1 to {limit}, got {shown(value)}")


def check_args(precision: str, steps: int, batch_size: int | None = None, seq_len: int | None = None) -> None:
    from memfit.techniques.accumulation import MAX_BATCH

    check_precision(precision)
    check_count("steps", steps, MAX_STEPS)
    for name, value, limit in (("batch_size", batch_size, MAX_BATCH), ("seq_len", seq_len, MAX_SEQ)):
        if value is not None:
            check_count(name, value, limit)


def check_switches(**values) -> None:
    """Keyword switches of the API that take True/False (None: the default) or a callable (None: none):
    ``fast="yes"`` or ``progress=3`` is one line here, not a TypeError deep in the trace or a silent truthy."""
    for name, value in values.items():
        if name in ("progress", "loss_fn"):
            if value is not None and not callable(value):
                raise MemfitError(f"{name} must be a callable or None, got {type(value).__name__} {shown(value, 40)}")
        elif value is not None and not isinstance(value, bool):
            raise MemfitError(f"{name} must be True or False, got {type(value).__name__} {shown(value, 40)}")


def check_workload(workload, recipe: Recipe) -> None:
    """``train`` or ``forward``, and a recipe a forward-only step can take."""
    from memfit.techniques.apply import WORKLOADS

    if workload == "generate":  # memfit.estimate (generation/workloads.py) sends it to estimate_generate
        raise MemfitError("workload='generate' is estimated by memfit.estimate(model, workload='generate', "
                          "prompt_len=..., new_tokens=...) or memfit.generation.estimate_generate(...)")
    if workload not in WORKLOADS:
        raise MemfitError(f"workload must be one of {', '.join(WORKLOADS)}, got {shown(workload)}")
    if workload == "forward":
        if recipe.parallel != "none":
            raise MemfitError(f"workload=forward and parallel={recipe.parallel} conflict: a forward-only step is "
                              "estimated on one card or with device_map; drop parallel")
        if recipe.grad_accum_steps > 1 or recipe.micro_batch_size:
            raise MemfitError("workload=forward runs the whole batch in one forward: drop micro_batch_size and "
                              "grad_accum_steps")


def placement_request(recipe: Recipe, device_map, max_memory, gpus, nodes, fast) -> dict:
    """``trace``'s placement request of a ``device_map`` run, after the checks that need no model."""
    from memfit.techniques.device_map import check_device_map, parse_max_memory

    if device_map is None:
        raise MemfitError("max_memory and offload_folder are for device_map placement: add device_map='auto' "
                          "(--device-map auto), or drop them")
    if recipe.parallel != "none":
        raise MemfitError(f"device_map and parallel={recipe.parallel} conflict: device_map splits one model over the "
                          "GPUs of one process, parallel runs one process per GPU; pick one")
    if recipe.compile:
        raise MemfitError("device_map and compile conflict: Accelerate's hooks move tensors between devices inside "
                          "the forward; drop compile")
    if nodes is not None:
        raise MemfitError("device_map places a model over the GPUs of one machine: drop nodes")
    if fast:
        raise MemfitError("fast=True and device_map conflict: a placed step is traced in full; leave fast unset")
    if gpus is not None and (not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1):
        raise MemfitError(f"gpus must be a positive integer, got {shown(gpus)}")
    return {"device_map": check_device_map(device_map), "max_memory": parse_max_memory(max_memory),
            "gpus": gpus or 0}


def recipe_world(recipe: Recipe, gpus, nodes):
    """The ``World`` of a multi-rank estimate, or None for one device; mismatches are one error."""
    from memfit.hardware.cluster import Layout, World, world_of

    world = world_of(gpus, nodes)
    if recipe.pp > 1 or recipe.tp > 1 or recipe.ep > 1 or recipe.cp > 1:
        if world is None:
            degrees = (("pp", recipe.pp), ("tp", recipe.tp), ("ep", recipe.ep), ("cp", recipe.cp))
            what = " x ".join(f"{n}={v}" for n, v in degrees if v > 1)
            raise MemfitError(f"{what} needs a GPU a part: pass gpus= "
                              f"(--gpus {recipe.pp * recipe.tp * recipe.ep * recipe.cp})")
        Layout.of_recipe(world, recipe)
        return world
    if recipe.parallel == "none":
        if world is not None and world.size > 1:
            raise MemfitError(f"gpus={world.size} needs a way to use them: parallel=ddp or parallel=fsdp "
                              "(--parallel fsdp)")
        return None
    return world or World()


def resolve_target(device, gpu):
    """None for CPU semantics, else the catalog GPU whose CUDA semantics to follow."""
    from memfit.hardware.gpus import GPU, gpu as lookup

    kind = str(device).split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise MemfitError(f"device {device!r} is not modelled: use device='cpu' or device='cuda'")
    if gpu is None:
        return lookup(DEFAULT_GPU) if kind == "cuda" else None
    card = gpu if isinstance(gpu, GPU) else lookup(gpu)
    if card.vendor == "apple":  # the watermark ratios this environment sets, refused before any tracing
        from memfit.hardware.mps import environment_limits

        environment_limits(card.working_set_bytes)
    return card


def budget_bytes(budget, target):
    """A budget in bytes for a CUDA estimate (checked against the card by ``verdict.limits``)."""
    if budget is None:
        return None
    if target is None:
        raise MemfitError("budget applies to CUDA estimates (the allocator under a memory fraction): "
                          "pass gpu=... or device='cuda', or compare report.peak_bytes yourself")
    from memfit.estimator.verdict import limits
    from memfit.units import parse_size

    budget = parse_size(budget)
    limits(target, budget)
    return budget


def step_batch(batch_size: int | None, recipe: Recipe, ranks: int = 1) -> int:
    """Examples per optimizer step of one rank. The rule: batch_size (over all ``ranks``) =
    ranks x micro_batch_size x grad_accum_steps when the recipe sets a micro-batch; a batch_size that
    disagrees, or that the ranks do not divide, is an error naming the fix."""
    if ranks > 1 and batch_size is not None:
        if batch_size % ranks:
            raise MemfitError(f"batch_size={batch_size} does not divide over {ranks} GPUs: batch_size is the examples "
                              f"of one optimizer step over all ranks; use a multiple of {ranks}")
        per_rank = batch_size // ranks
        if recipe.micro_batch_size and per_rank != recipe.micro_batch_size * recipe.grad_accum_steps:
            per_step = recipe.micro_batch_size * recipe.grad_accum_steps
            raise MemfitError(f"batch_size={batch_size} over {ranks} GPUs is {per_rank} per rank, and micro_batch_size="
                              f"{recipe.micro_batch_size} x grad_accum_steps={recipe.grad_accum_steps} = {per_step} "
                              f"conflict: use batch_size={per_step * ranks}, or leave batch_size out")
        return step_batch(per_rank, recipe)
    if not recipe.micro_batch_size:
        return batch_size or 1
    per_step = recipe.micro_batch_size * recipe.grad_accum_steps
    if batch_size not in (None, per_step):
        mb, steps = recipe.micro_batch_size, recipe.grad_accum_steps
        fix = (f"set grad_accum_steps={batch_size // mb}" if batch_size % mb == 0 and batch_size // mb <= MAX_ACCUM_STEPS
               else "change one of them")
        raise MemfitError(f"batch_size={batch_size} and micro_batch_size={mb} x grad_accum_steps={steps} "
                          f"= {per_step} conflict: batch_size is the examples of one optimizer step; {fix}, "
                          "or leave batch_size out")
    return per_step
