"""One rank's estimate of a multi-GPU run: FSDP2 / DDP / tensor, pipeline, expert and context parallel.

Each kind of rank (rank 0; every pipeline stage; the first and last context-parallel peer; the last
rank of a stage whose parameters split unevenly) is traced under PyTorch's fake process group
(``hardware/cluster.py``), its collectives moving no data; the report is the rank with the highest
peak, ``report.ranks`` holds each, ``report.world`` the mesh. An FSDP2 model built whole in host RAM
adds the host's side (``construction=host``).

Left out: variable-length data (``lengths``, ``packed``) per rank.
"""

from __future__ import annotations

import dataclasses

from memfit.errors import MemfitError
from memfit.estimator.traced import ticker, traced
from memfit.estimator.trace import phases
from memfit.hardware.cpu_kernels import check_routing
from memfit.models.source import resolve
from memfit.report.report import Report
from memfit.techniques.recipe import Recipe

__all__ = ["estimate_ranks"]


def estimate_ranks(model, batch, world, *, recipe, progress, moe_routing, lengths, packed, fast, **kwargs) -> Report:
    """One rank's estimate under the fake process group: rank 0, then the last rank when a parameter
    does not split evenly (its shards, and the optimizer state on them, are smaller). The report is
    the rank with the highest peak; ``ranks`` lists each."""
    import torch

    if lengths is not None or packed:
        raise MemfitError("lengths= and packed= are not estimated per rank yet: drop them, or gpus=")
    from memfit.techniques.pipeline_parallel import FAST_SCHEDULES

    looped = recipe.pp > 1 and recipe.pp_schedule not in FAST_SCHEDULES
    if (recipe.parallel != "fsdp" and recipe.pp == 1) or recipe.offload != "none" or looped \
            or (recipe.tp > 1 and recipe.parallel != "fsdp"):
        # DDP's gradient buckets, an offloaded step's host side, a looped schedule's two stages a rank and TP
        # without FSDP2 (its fast path was 3% off its full trace, bf16 autocast over 4 ranks): in full
        what = (f"pp_schedule={recipe.pp_schedule}" if looped else f"tp={recipe.tp} without fsdp" if recipe.tp > 1
                else f"parallel={recipe.parallel}" if recipe.parallel != "fsdp" else f"offload={recipe.offload}")
        if fast:
            raise MemfitError(f"fast=True and {what} conflict: that step is traced in full (its memory is not laid "
                              "out block by block for the depth fast path); leave fast unset")
        fast = False
    source = dataclasses.replace(resolve(model), moe_routing=check_routing(moe_routing))
    threads = torch.get_num_threads()
    # torchrun starts each process with OMP_NUM_THREADS=1 (its default with several per node), and the CPU's
    # kernel scratch (oneDNN's, of a bf16 matmul) depends on the thread count: a rank is probed as one thread
    torch.set_num_threads(1)
    try:
        return _each_rank(source, batch, world, recipe=recipe, progress=progress, fast=fast, **kwargs)
    finally:
        torch.set_num_threads(threads)


def _each_rank(source, batch, world, *, recipe, progress, fast, **kwargs) -> Report:
    """``estimate_ranks``' traces, one fake world a rank, and the report of the worst."""
    from contextlib import nullcontext

    from memfit.hardware.cluster import Layout, fake_world
    from memfit.techniques.deepspeed import torch_as_found
    from memfit.techniques.pipeline_parallel import cut
    from memfit.techniques.zero_config import STAGES

    layout = Layout.of_recipe(world, recipe)
    reports = []
    # every pipeline stage is its own kind of rank (its blocks, the micro-batches it keeps in flight); TP peers
    # and the data-parallel ranks of a stage hold equal parts
    queue = [layout.rank(pp=s) for s in range(recipe.pp)] if recipe.pp > 1 else [0]
    if recipe.cp > 1:
        # the ring's causal chunks differ by position: the first CP rank runs every later step on half its queries,
        # the last on half the keys; the ranks between mix the two and hold no more than these (bench/distributed/distributed.py)
        queue = [layout.rank(shard=0), layout.rank(shard=recipe.cp - 1)]
    parts = cut(source.depth, recipe.pp) if recipe.pp > 1 and source.depth else None
    for rank in queue:  # grows while it is read: the last rank of a stage whose parameters split unevenly
        with fake_world(world, rank) as place, torch_as_found() if recipe.parallel in STAGES else nullcontext():
            tick = ticker(progress, phases(recipe, kwargs["steps"]))
            stage = layout.coords(rank)["pp"]
            report = traced(source, batch, recipe=recipe, fast=fast, tick=tick, layout=None,
                               stage=(stage, parts[stage]) if parts else None, **kwargs)
            reports.append((rank, report))
            uneven = place.notes.get("uneven")
        # a parameter that does not split evenly leaves the stage's last rank smaller shards (and optimizer state)
        last = (stage + 1) * world.size // recipe.pp - 1
        if uneven and last not in queue:
            queue.append(last)
    top_rank, top = max(reports, key=lambda pair: (pair[1].device_bytes + (pair[1].missing_bytes or 0),
                                                   pair[1].peak_bytes))
    host = {}
    if recipe.parallel == "fsdp" and recipe.construction == "host":
        host = _built_on_host(top, _whole_model_bytes(source, recipe))
    ranks = [{"rank": r, "peak_bytes": rep.peak_bytes, "device_bytes": rep.device_bytes, "host_bytes": rep.host_bytes,
              "by_category": rep.by_category, "phase_peaks": rep.phase_peaks} for r, rep in reports]
    meshed = recipe.pp > 1 or recipe.tp > 1 or recipe.ep > 1 or recipe.cp > 1
    shape = layout.describe() if meshed else recipe.parallel
    if recipe.pp > 1:
        shape += f", {recipe.pp_schedule} over {recipe.grad_accum_steps} micro-batches"
    if meshed and layout.dp > 1:
        shape += f", {recipe.parallel} over dp" + (" x cp" if recipe.cp > 1 else "")
    notes = [f"rank {top_rank} of {world.describe()} ({shape}): one rank's step under PyTorch's fake "
             "process group; collectives move no data and take no time"]
    if recipe.parallel == "fsdp":
        notes.append({"meta": "construction=meta: built on the meta device, sharded, then materialised (to_empty), "
                              "as torchtitan does; a rank never holds the whole model",
                      "host": "construction=host: built whole in each rank's host RAM, then sharded onto the GPU "
                              "(host_bytes); the GPU never holds the whole model",
                      "device": "construction=device: built whole on the GPU, then sharded; the construction is "
                                "traced with the step and its peak counts"}[recipe.construction])
    if uneven:
        notes.append(f"uneven shards ({uneven}): rank 0 and rank {world.size - 1} traced")
    if recipe.cp > 1:
        from memfit.techniques.context_parallel import UNCHECKED_ON_GPU

        notes.append(UNCHECKED_ON_GPU)
    info = {"gpus": world.gpus, "nodes": world.nodes, "size": world.size, "parallel": recipe.parallel, "tp": recipe.tp,
            "pp": recipe.pp, "ep": recipe.ep, "cp": recipe.cp, "mesh": layout.describe(),
            "rank": top_rank, "construction": recipe.construction if recipe.parallel == "fsdp" else "replicated"}
    return dataclasses.replace(top, world=info, ranks=ranks, notes=top.notes + notes + host.pop("notes", []), **host)


def _whole_model_bytes(source, recipe: Recipe) -> int:
    """Bytes of every parameter and buffer of the model as built (in the recipe's weight dtype), before
    any sharding: built on the meta device, so nothing is allocated."""
    import torch

    from memfit.techniques.precision import weight_dtype

    dtype = weight_dtype(recipe.precision)
    with torch.device("meta"):
        model = source.build()
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    return sum(t.numel() * (dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size())
               for t in tensors)


def _built_on_host(report, whole: int) -> dict:
    """Report fields of an FSDP2 model built whole in each rank's host memory, then sharded: the host holds
    the whole model until it is sharded (before the step), and an offloaded step's host side after."""
    from memfit.units import format_size

    return {"host_bytes": max(report.host_bytes or 0, whole),
            "notes": [f"construction=host: each rank builds the whole model in host RAM ({format_size(whole)}), then "
                      "shards it onto its GPU; a node's ranks together need that many times --gpus of host RAM "
                      "while they do"]}

