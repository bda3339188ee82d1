"""Independent truth on CPU: the allocator's own events, read through ``torch.profiler``.

This is what estimates are graded against in tests and bench/. It shares nothing with the
ledger: ``profile(profile_memory=True)`` records every allocation and free the CPU allocator
serves (kernel scratch included), and the peak is the highest running sum of those events.
"""

from __future__ import annotations

import gc

import torch
from torch.profiler import ProfilerActivity, profile

from memfit.accounting.allocator_events import allocation_sizes, span
from memfit.techniques.apply import inner_tensors, run_steps
from memfit.techniques.lora import prepare_lora
from memfit.techniques.recipe import recipe_from
from memfit.techniques.step import batch_tensors
from memfit.scoped import quiet_profiler

__all__ = ["allocator_peak", "allocator_steps", "true_peak", "resident_bytes"]


def allocator_peak(fn) -> int:
    """Highest bytes allocated above the level at entry while ``fn()`` runs on CPU.

    Garbage left by earlier work (tensors in reference cycles) is collected first: freed while
    ``fn()`` runs, its storages would count as negative and lower the peak by whatever the
    process happened to hold, which made the truth depend on what ran before it."""
    gc.collect()
    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return span(allocation_sizes(*prof.profiler.kineto_results.experimental_event_tree()))[0]


def allocator_steps(steps) -> tuple[int, list[int]]:
    """(highest bytes allocated above the level at entry, the net bytes each step left) while the
    iterator ``steps`` runs, one profiler session per item: a user's loop written as a generator that
    yields after each optimizer step. A clean loop leaves 0 after its first steps; a leak its bytes."""
    gc.collect()
    running = peak = 0
    nets = []
    iterator = iter(steps)
    while True:
        with quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            try:
                next(iterator)
                done = False
            except StopIteration:
                done = True
        sizes = allocation_sizes(*prof.profiler.kineto_results.experimental_event_tree())
        for size in sizes:
            running += size
            peak = max(peak, running)
        if done:
            return peak, nets
        nets.append(sum(sizes))


def resident_bytes(model, batch, extra=()) -> int:
    """Bytes of the distinct storages of ``model``'s parameters and buffers, ``batch`` and ``extra`` (of a
    tensor subclass, such as a QLoRA weight in torchao's NF4, its inner tensors')."""
    seen, total = set(), 0
    every = list(model.parameters()) + list(model.buffers()) + batch_tensors(batch) + list(extra)
    for t in (inner for tensor in every for inner in inner_tensors(tensor)):
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def true_peak(factory, batch, *, loss_fn=None, optimizer="adamw", precision="fp32", steps=2, recipe=None,
              workload: str = "train") -> int:
    """Peak bytes of real CPU steps as the allocator saw them, plus what existed before them.

    The steps are the recipe's step (``memfit.apply``) with nobody watching: no ledger, no hooks.
    Weights are cast for pure bf16 before counting what exists, as the estimate does.
    """
    recipe, custom = recipe_from(recipe, precision, optimizer)
    torch.manual_seed(0)
    model = factory()
    if recipe.precision == "bf16":
        model.to(torch.bfloat16)
    extra = prepare_lora(model, recipe)  # a quantised model, as a quantised checkpoint would load
    base = resident_bytes(model, batch, extra)
    peak = allocator_peak(lambda: run_steps(model, batch, recipe=recipe, steps=steps, optimizer=custom,
                                            loss_fn=loss_fn, workload=workload))
    return base + peak
