"""The answer to a script's run on fake tensors: the usual Report, and the script's lines at the peak and the OOM.

The card's side of the log (``device.py``'s placer marks the host's storages) is replayed through memfit's
caching allocator (``estimator/verdict.cuda_fit``) for allocated, reserved and the verdict; the categories,
phases and steps are the ledger's (tensor bytes), as for a profile on CUDA. Two sites are read from the
log: the allocation that brings ``max_memory_allocated`` to its peak, and, when the card runs out, the
allocation torch would fail on (a replay under the card's limit, ``accounting/cuda_allocator.py``), each
as the innermost frame of the user's code with its source line.
"""

from __future__ import annotations

import linecache

from memfit.accounting.events import ALLOC, FREE, RENAME, storage_events
from memfit.accounting.replay import LedgerView, replay
from memfit.accounting.scratch import measure_scratch
from memfit.estimator.trace import fold_peaks, numel
from memfit.estimator.verdict import cuda_fit, limits, outside_fields
from memfit.profiling.sites import largest_at, short
from memfit.report.report import Report
from memfit.units import format_size

__all__ = ["report", "site_of"]


def site_of(watch, index: int) -> dict | None:
    """Record ``index``'s allocation site in the user's code: file, line, code, site ("file.py:LINE"), the
    stack (innermost first); None when no user frame made it."""
    stack, at = watch.stack(index)
    if at < 0 or not stack:
        return None
    filename, line, function = stack[0]
    return {"file": short(filename), "line": line, "function": function, "site": f"{short(filename)}:{line}",
            "code": linecache.getline(filename, line).strip(),
            "stack": [f"{short(f)}:{n} in {name}" for f, n, name in stack]}


def _card_side(watch):
    keep = {i for i, record in enumerate(watch.records) if record.device is None}
    view = LedgerView(watch, keep, spikes=False)
    view.stack = watch.stack  # each record's allocation stack, for the largest allocations at the peak
    return view


def _allocator_walk(view, records, capacity=None, allowed=None):
    """(record index at the allocated peak, peak allocated, record index whose malloc fails or None, the
    failing request's bytes): the card's events through a fresh caching allocator."""
    from memfit.accounting.cuda_allocator import CachingAllocator
    from memfit.accounting.cuda_blocks import SimulatedOutOfMemory

    allocator = CachingAllocator(capacity=capacity, allowed_memory=allowed) if capacity is not None \
        else CachingAllocator()
    handles: dict[int, int] = {}
    peak, at = -1, None
    for kind, index in storage_events(view):
        if kind == ALLOC:
            try:
                handles[index] = allocator.malloc(records[index].nbytes, stream=records[index].stream)
            except SimulatedOutOfMemory as oom:
                return at, peak, index, oom.alloc_size
            allocated = allocator.stats.allocated
            if allocated > peak:
                peak, at = allocated, index
        elif kind == RENAME and records[index].donor in handles:
            handles[index] = handles.pop(records[index].donor)
        elif kind == FREE and index in handles:
            allocator.free(handles.pop(index))
    return at, peak, None, 0


def report(prof, card, *, budget, what, status, files, reads, steps_asked, fraction=None, groups=None,
           rank: int = 0, compiled=None, bounds: int = 0) -> Report:
    watch = prof.watch
    steps = max(prof.steps, 1)
    if card is None:
        scratch, unprobed = measure_scratch(watch)
        view = watch
    else:
        scratch, unprobed = [0] * len(watch.sites), 0
        view = _card_side(watch)
    result = replay(view, scratch)
    notes = [f"{prof.steps} optimizer step(s) of {what.name} run on fake tensors"
             + (" (then stopped)" if steps_asked and prof.steps >= steps_asked else " (the whole script)")]
    fields, script = {}, {"argv": what.argv, "module": what.module, "exit_status": status, "steps": prof.steps}
    if groups is not None:
        script.update(rank=rank, world_size=groups.world_size, process_groups=groups.count)
        notes.append(f"rank {rank} of {groups.world_size}" + (f" ({groups.count} process group(s) on PyTorch's fake "
                     "backend)" if groups.count else " (the script made no process group)"))
    if card is not None:
        found = _outside(card, watch, groups)
        if budget is None and fraction is not None:  # the script capped itself: the allocator may hold that much
            budget = min(int(fraction * card.memory_bytes) + found.bytes, card.memory_bytes)
            notes.append(f"the script set a memory fraction of {fraction:g}: the verdict is under it")
        verdict = cuda_fit(view, card, budget, outside=found.bytes)
        fields = dict(verdict.report_fields(), **outside_fields(found), gpu=card.name)
        at, peak, _, _ = _allocator_walk(view, watch.records)
        script["peak"] = None if at is None else site_of(watch, at)
        if verdict.verdict == "out_of_memory":
            capacity, allowed = limits(card, budget, found.bytes)
            _, _, failing, size = _allocator_walk(view, watch.records, card.memory_bytes - found.bytes, allowed)
            if failing is not None:
                script["oom"] = dict(site_of(watch, failing) or {}, request_bytes=size,
                                     missing_bytes=verdict.missing_bytes)
        host = [i for i, r in enumerate(watch.records) if r.device is not None]
        if host:
            on_host = replay(LedgerView(watch, set(host), spikes=False), [0] * len(watch.sites))
            script["host_peak_bytes"] = on_host.peak_bytes
            notes.append(f"host tensors (data on the CPU, left out of the card's figures) peaked at "
                         f"{format_size(on_host.peak_bytes)}")
    else:
        at = _peak_record(view, result.peak_event)
        script["peak"] = None if at is None else site_of(watch, at)
    if bounds:
        notes.append(f"{bounds} data-dependent size(s) (nonzero, boolean masks, unique) taken at their upper bound: "
                     "every element selected (a mixture of experts' routing: every token to every expert)")
        script["upper_bounds"] = bounds
    if compiled is not None and compiled.count:
        notes.append(f"torch.compile: {compiled.count} call(s) estimated with Inductor's own plan (no-op kernels)")
        script["compiled"] = compiled.count
    notes.extend(compiled.notes if compiled is not None else [])
    if files.skipped:
        shown = ", ".join(f"{path} ({call})" for path, call in files.skipped[:4])
        more = f" and {len(files.skipped) - 4} more" if len(files.skipped) > 4 else ""
        notes.append(f"not written: {shown}{more} (a save's host copy is not the card's memory)")
    script["not_written"] = [{"path": p, "call": c} for p, c in files.skipped]
    script["built_from_config"] = files.built
    if files.built:
        notes.append(f"from_pretrained built from the config, no weights read: {', '.join(files.built)}")
    if reads:
        notes.append(f"{reads} value(s) the script read back (.item(), printing a loss, .numpy()) were "
                     "placeholders: 0, no inf found, masks all true")
    if unprobed:
        notes.append(f"{unprobed} large op call(s) were not replayed for kernel scratch; their scratch is not counted")
    model = watch.model
    params = list(model.parameters()) if model is not None else []
    settings = {"steps": prof.steps, "workload": "train", "inputs": prof.inputs, "budget": budget, "script": script}
    peak = fields.pop("peak_bytes", result.peak_bytes)
    return Report(
        peak_bytes=peak,
        by_category=result.by_category,
        **fold_peaks(result.phase_peaks, steps),
        modules=result.modules,
        timeline=result.timeline,
        stacked=result.stacked,
        device="cpu" if card is None else "cuda",
        method="script",
        modelled_bytes=result.scratch_at_peak,
        unprobed_ops=unprobed,
        parameters=sum(numel(p) for p in params),
        trainable=sum(numel(p) for p in params if p.requires_grad),
        settings=settings,
        notes=notes,
        top_allocations=largest_at(view, result.peak_event),
        **fields,
    )


def _peak_record(view, peak_event: int):
    """The record whose allocation is at or last before the peak's event."""
    events = view.events
    for number in range(min(peak_event, len(events) - 1), -1, -1):
        kind, index = events[number]
        if kind == ALLOC:
            return index
    return None


def _outside(card, watch, groups):
    """What the process holds outside the allocator on ``card``: a training process's terms, cuBLAS if a matmul
    ran, an NCCL communicator per process group with peers (``hardware/outside.py``)."""
    from memfit.hardware.outside import Workload, outside

    peers = groups is not None and groups.world_size > 1
    return outside(card, Workload(kind="train", matmul="cublas" in watch.libraries,
                                  communicators=groups.count if peers else 0,
                                  world_size=groups.world_size if groups is not None else 1))
