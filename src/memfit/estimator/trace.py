"""Run training steps under a ledger and make a ``Report`` of them.

The one path shared by ``estimate`` (fake tensors) and ``measure`` (real tensors): register what
exists before the step, run the step, replay the log, add kernel scratch measured by the
allocator, and describe the result.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch

from memfit.accounting.ledger import Ledger
from memfit.accounting.ops import OpCounter
from memfit.accounting.replay import LedgerView, event_series, replay
from memfit.accounting.scratch import measure_scratch
from memfit.categories import PHASES, Category
from memfit.hardware.cuda import card_semantics
from memfit.estimator.rebudget import offer
from memfit.estimator.verdict import cuda_fit, outside_fields, process_outside
from memfit.report.report import Report
from memfit.techniques.apply import run_steps
from memfit.techniques.step import batch_tensors
from memfit.techniques.lora import prepare_lora, quant_state_tensors
from memfit.units import format_size

__all__ = ["trace", "model_device", "numel", "fold_peaks", "phases"]


def model_device(model: torch.nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


def trace(model, batch, *, recipe, loss_fn, optimizer, steps, method: str, gpu=None, detail: bool = False,
          prime: int | None = None, keep: bool = False, budget: int | None = None, tick=None, placement=None,
          workload: str = "train"):
    """(Report, Replay) of ``steps`` steps of ``model`` on ``batch``, real or fake.

    ``gpu`` (a catalog ``GPU``): follow CUDA semantics (``memfit.cuda``) for that device, and replay
    the allocator under its memory, or under ``budget`` (bytes, context included; ``memfit/estimator/verdict.py``).
    ``detail``: also keep the live bytes after every event (``Replay.series``) and one row per
    kernel (``Replay.ops``, see ``accounting/ops.py``), and the allocator statistics on CUDA
    (``Replay.allocator``), for the planner. ``keep``: keep the ledger and its kernel scratch
    (``Replay.ledger``, ``Replay.scratch``), for the depth fast path. ``prime``: the batch dimension is this prime; the
    series and rows also say which bytes scale with it. ``tick()`` is called as each phase
    (forward, backward, optimizer) begins and once when the replay is done: ``phases(recipe, steps)``.
    ``placement`` (``techniques.device_map.Placement``): the model run over several devices as Accelerate
    dispatches it; the report is the GPU that needs the most, ``devices`` lists each (``estimator/placed.py``).
    ``workload="forward"``: ``steps`` forwards without gradients instead of training steps.
    """
    device = model_device(model)
    prepare_lora(model, recipe)  # peft imported, a QLoRA base quantised: neither is part of the step
    placed = placement
    ledger = Ledger(device=device, model=model,
                    cublas_workspace=None if gpu is None else gpu.cublas_workspace_bytes)
    if gpu is not None:
        ledger.follow(gpu)
    ledger.prime = prime
    ledger.on_phase = tick
    _register(ledger, model, batch)
    counter = OpCounter(ledger, prime) if detail else contextlib.nullcontext()
    dispatch = contextlib.nullcontext()
    if placed is not None:
        from memfit.techniques.dispatch import dispatched

        dispatch = dispatched(model, placed, ledger, training=workload == "train")
    try:
        with ledger, counter, (card_semantics(gpu) if gpu is not None else contextlib.nullcontext()), dispatch as placer:
            run_steps(model, batch, recipe=recipe, steps=steps, optimizer=optimizer, loss_fn=loss_fn,
                      watch=ledger, workload=workload)
    finally:
        ledger.close()
    scratch, unprobed = measure_scratch(ledger)
    result = replay(ledger, scratch)
    if tick is not None:
        tick()
    params = list(model.parameters())
    cuda, host = {}, {}
    device_side = ledger
    found = process_outside(gpu, ledger, recipe, workload) if gpu is not None else None
    if placed is not None:
        from memfit.estimator.placed import placed_sides

        device_side, host = placed_sides(ledger, scratch, placer, gpu, budget, found.bytes if found else None)
        result = replay(device_side, scratch)
    elif getattr(recipe, "offload", "none") != "none":
        device_side, host = _offloaded(ledger, scratch, recipe, cuda=gpu is not None)
        if gpu is not None:  # the GPU's figures are of what stays on it; on the CPU all is one memory
            result = replay(device_side, scratch)
    elif ledger.host and gpu is not None:  # an offloaded optimizer (torchao's, ZeRO-Offload) on a trace for a card:
        device_side, host = _optimizer_offloaded(ledger, recipe)  # its host side off the GPU's figures
        result = replay(device_side, scratch)
    if gpu is not None:
        verdict = cuda_fit(device_side, gpu, budget, outside=found.bytes)
        cuda = dict(verdict.report_fields(), **outside_fields(found), gpu=gpu.name)
        if device_side is ledger:  # one device's whole step: the planner may replay it under a budget
            offer(ledger, gpu, found.bytes, verdict)
        result.allocator = verdict.unlimited  # the planner composes unlimited figures
    if keep:
        result.ledger, result.scratch = ledger, scratch
    if detail:
        result.series = event_series(ledger, scratch, prime)
        result.ops = counter.rows
        result.offloaded_bytes = ledger.offloaded_bytes
        result.offloaded_scaled = ledger.offloaded_scaled
    return Report(
        peak_bytes=cuda.pop("peak_bytes", result.peak_bytes),
        by_category=result.by_category,
        **fold_peaks(result.phase_peaks, steps),
        modules=result.modules,
        timeline=result.timeline,
        stacked=result.stacked,
        device=device.type if gpu is None else "cuda",
        method=method,
        modelled_bytes=result.scratch_at_peak,
        unprobed_ops=unprobed,
        parameters=sum(numel(p) for p in params),
        trainable=sum(numel(p) for p in params if p.requires_grad),
        settings={
            "recipe": recipe.to_dict(),
            "precision": recipe.precision,
            "optimizer": getattr(optimizer, "__name__", "custom") if optimizer else recipe.optimizer,
            "steps": steps,
            "workload": workload,
            "batch_shapes": [list(t.shape) for t in batch_tensors(batch)],
        },
        notes=_notes(unprobed, ledger.attention_matrices, cuda=gpu is not None, card=gpu) + host.pop("notes", []),
        **cuda,
        **host,
    ), result


def _offloaded(ledger, scratch, recipe, cuda: bool = True):
    """(the GPU's side, report fields of the host's side) of an FSDP2 step with ``CPUOffloadPolicy``."""
    from memfit.accounting.replay import replay as replay_log
    from memfit.techniques.fsdp_step import host_records

    host = host_records(ledger)
    changed = True
    while changed:  # an in-place pair (and so a chain of them) stays on one side: the GPU's
        changed = False
        for index, record in enumerate(ledger.records):
            if record.donor is not None and (index in host) != (record.donor in host):
                host.discard(index)
                host.discard(record.donor)
                changed = True
    device = set(range(len(ledger.records))) - host
    pinned, view = 0, ledger
    if recipe.offload == "cpu" and cuda:  # pinning needs a GPU: a CPU-only run shards unpinned
        # FSDP2 pins the shards and their gradients (``pin_memory()``; a ``non_blocking`` copy to the host lands in
        # pinned memory), not the optimizer state. torch's pinned-memory caching allocator (CachingHostAllocator)
        # serves each request from a block of the next power of two: an H200 run of Llama-3.2-3B held 36.25 GB
        # there for 25.70 GB of shards and gradients (torch.cuda.host_memory_stats), as this rounding gives.
        # Each parameter's shard is its own pinned tensor, and so is each sharded gradient's copy to the host
        # (one ``.to("cpu", non_blocking=True)`` per parameter): the fake step, run on the host, makes no such
        # copies, its gradient records are FSDP2's flat reduce-scatter outputs, so gradients are rounded as the
        # shards they mirror are (the same parameters, the same bytes).
        shards = [r.nbytes for i, r in enumerate(ledger.records) if i in host and r.category == Category.PARAMETERS]
        rounded, plain = sum(_pow2(n) for n in shards), max(sum(shards), 1)
        view = copy.copy(ledger)
        view.records = [dataclasses.replace(r, nbytes=_pow2(r.nbytes) if r.category == Category.PARAMETERS
                                            else r.nbytes * rounded // plain)
                        if i in host and r.category in (Category.PARAMETERS, Category.GRADIENTS) else r
                        for i, r in enumerate(ledger.records)]
    on_host = replay_log(LedgerView(view, host, spikes=False), [0] * len(ledger.sites))
    if recipe.offload == "cpu":
        pinned = sum(on_host.by_category.get(c.value, 0) for c in (Category.PARAMETERS, Category.GRADIENTS))
    fields = {"host_bytes": on_host.peak_bytes, "pinned_bytes": pinned,
              "notes": [f"offload={recipe.offload}: the shards, their gradients and the optimizer step on the host: "
                        f"{format_size(on_host.peak_bytes)} of host RAM at its peak"
                        + (f", {format_size(pinned)} of it pinned" if pinned else "")
                        + "; each unit's shard crosses the host link for its all-gather and each sharded gradient "
                        "back (small transients on the GPU not traced)"]}
    # Each sharded gradient is made on the GPU, in its reduce-scatter stream (the reduce-scatter's output, or
    # its cast to the shards' dtype), then copied to the host; the fake step, run on the host, makes it there.
    # The GPU holds it from its making to the copy.
    from memfit.techniques.fsdp_step import REDUCE_SCATTER_STREAM

    staged = frozenset(i for i in host if ledger.records[i].category == Category.GRADIENTS
                       and ledger.records[i].stream == REDUCE_SCATTER_STREAM and ledger.records[i].donor is None
                       and not ledger.records[i].donated)
    return LedgerView(ledger, device, spikes=True, transient=staged), fields


def _optimizer_offloaded(ledger, recipe):
    """(the GPU's side, report fields of the host's side) of a step with torchao's CPUOffloadOptimizer or
    DeepSpeed's ZeRO-Offload: the records ``on_host`` / ``host_tensor`` marked (torchao's pinned copy of each
    parameter and gradient, ZeRO's host partitions, the optimizer's state and step) are the host's. Pinned blocks are
    rounded as torch's pinned-memory allocator serves them (``_pow2``)."""
    from memfit.accounting.replay import replay as replay_log

    host = set(ledger.host)
    view = copy.copy(ledger)
    view.records = [dataclasses.replace(r, nbytes=_pow2(r.nbytes)) if i in ledger.pinned else r
                    for i, r in enumerate(ledger.records)]
    on_host = replay_log(LedgerView(view, host, spikes=False), [0] * len(ledger.sites))
    # ZeRO-Offload pins what its sections' pin_memory say (true by default in 0.19.8): the most page-locked at once
    pinned = replay_log(LedgerView(view, set(ledger.pinned), spikes=False), [0] * len(ledger.sites)).peak_bytes \
        if ledger.pinned else 0
    if getattr(recipe, "parallel", "none").startswith("zero"):
        note = (f"ZeRO-Offload ({recipe.zero}): the offloaded partitions and the optimizer step on the host: "
                f"{format_size(on_host.peak_bytes)} of host RAM at its peak, {format_size(pinned)} of it pinned (the "
                "sections' pin_memory); each gradient partition crosses the host link to it and each updated one back")
    else:
        note = (f"offload_optimizer: a pinned copy of each parameter and gradient and the optimizer step on the host "
                f"(torchao's CPUOffloadOptimizer): {format_size(on_host.peak_bytes)} of host RAM at its peak, "
                f"{format_size(pinned)} of it pinned; each gradient crosses the host link to it and each updated "
                "weight back")
    fields = {"host_bytes": on_host.peak_bytes, "pinned_bytes": pinned, "notes": [note]}
    return LedgerView(ledger, set(range(len(ledger.records))) - host, spikes=True), fields


def _pow2(nbytes: int) -> int:
    """The block the pinned host allocator serves ``nbytes`` from (``c10::llvm::PowerOf2Ceil``)."""
    return 1 << max(nbytes - 1, 0).bit_length() if nbytes else 0


def _register(ledger, model, batch) -> None:
    """What exists before the step. A function of its own: a loop variable left in ``trace``'s frame
    would keep the last parameter alive after FSDP2 replaced it with its shard."""
    for param in list(model.parameters()) + quant_state_tensors(model):
        ledger.register(param, Category.PARAMETERS)
    for buf in model.buffers():
        ledger.register(buf, Category.BUFFERS)
    for tensor in batch_tensors(batch):
        ledger.register(tensor, Category.BATCH)


def fold_peaks(peaks: dict, steps: int, names: tuple[str, ...] = PHASES) -> dict:
    """A replay's peaks by (step, phase) folded into the Report's ``phase_peaks`` (each phase of ``names``
    over all steps) and ``step_peaks`` (each step over its phases). A generation's phases are
    ``GENERATE_PHASES`` and its steps its forwards (``memfit.generation``)."""
    return {"phase_peaks": {p: max((v for (s, ph), v in peaks.items() if ph == p), default=0) for p in names},
            "step_peaks": [max((v for (s, ph), v in peaks.items() if s == step and ph in names), default=0)
                           for step in range(steps)]}


def phases(recipe, steps: int, workload: str = "train") -> int:
    """How often ``trace`` ticks: forward and backward of each micro-batch and the optimizer, per
    step, and the replay (a forward-only workload: one forward per step)."""
    if workload == "forward":
        return steps + 1
    return steps * (2 * recipe.grad_accum_steps + 1) + 1


def numel(param) -> int:
    """Logical weights of a parameter: a 4-bit one stores two per byte (``quant_state.shape``); one DeepSpeed's
    ZeRO-3 partitioned is empty between its gathers (``ds_numel``: its whole size)."""
    state = getattr(param, "quant_state", None)
    if state is not None:
        return int(torch.Size(state.shape).numel())
    return getattr(param, "ds_numel", None) or param.numel()


def _notes(unprobed: int, attention: dict[str, int], cuda: bool = False, card=None) -> list[str]:
    notes = []
    if unprobed:
        notes.append(f"{unprobed} large op call(s) were not replayed for kernel scratch; their scratch is not counted")
    if attention:
        module, nbytes = max(attention.items(), key=lambda kv: kv[1])
        unfused = card is not None and not card.fused_attention
        notes.append(f"{len(attention)} module(s) materialise the full S x S attention matrix ({format_size(nbytes)} "
                     f"each in {module}); " + (
                         f"the {card.name} has no fused attention kernel for training ({card.semantics}): a shorter "
                         "sequence or activation checkpointing lowers it" if unfused else
                         "on CUDA the fused SDPA kernels avoid it, but fp32 grouped-query attention has none: "
                         "bf16-mixed or attention=sdpa" if cuda else
                         "SDPA's memory-efficient kernels avoid it (attention=sdpa; on CPU only without dropout)"))
    return notes
