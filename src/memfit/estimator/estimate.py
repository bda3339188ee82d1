"""``estimate``: the memory of training steps, computed on fake tensors.

The user's step runs unchanged under ``FakeTensorMode``: every op computes shapes and dtypes
only, so a 70B model costs no memory and no GPU. Measured on CPU, the result matches the
allocator to the byte where nothing is hidden inside kernels; kernel scratch is replayed per op
(``accounting/scratch.py``). For deep Hugging Face models a fast path traces two shallow copies
and scales by depth (``depth.py``).
"""

from __future__ import annotations

import dataclasses

from memfit.hardware.cpu_kernels import check_routing
from memfit.hardware.gpus import DEFAULT_GPU, Target, target
from memfit.errors import MemfitError, shown
from memfit.estimator.checkpoint import checkpoint_recipe, with_checkpoint
from memfit.estimator.fake_trace import fake_trace
from memfit.models.source import resolve
from memfit.techniques.precision import check_gpu, check_precision
from memfit.techniques.accumulation import MAX_ACCUM_STEPS, MAX_BATCH
from memfit.techniques.recipe import Recipe, recipe_from
from memfit.report.report import Report
from memfit.estimator.trace import phases

__all__ = ["estimate", "estimate_micro_batch", "resolve_target", "DEFAULT_GPU", "check_args", "step_batch", "targeted"]

# Below this depth a full trace is cheap enough that the fast path buys nothing.
FAST_MIN_DEPTH = 8
# Accumulation steps past which the estimate reads the peak off the line through 2 and 3 micro-batches
# (fast=False traces every one), and up to which a verdict near the limit is traced in full instead.
LINE_FROM = 5
FULL_ACCUMULATION = 16


def estimate(model, batch=None, *, loss_fn=None, optimizer="adamw", precision: str = "fp32",
             steps: int = 2, batch_size: int | None = None, seq_len: int | None = None,
             device: str | None = None, gpu=None, fast: bool | None = None, recipe: Recipe | None = None,
             moe_routing: str = "balanced", budget=None, progress=None, lengths=None, packed: bool = False,
             gpus: int | None = None, nodes: int | None = None, device_map=None, max_memory=None,
             offload_folder: str | None = None, workload: str = "train") -> Report:
    """Estimate the memory of ``steps`` training steps without allocating it.

    model      an ``nn.Module``; a zero-argument callable building one (built on the meta device,
               then made fake); a catalog name (``"llama-3.1-8b"``); a path to a Hugging Face
               ``config.json``; or ``"package.module:function"``.
    batch      a tensor, tuple or dict of tensors (converted to fake), or a zero-argument
               callable returning one. ``None`` for catalog / config models: a batch of
               ``batch_size`` x ``seq_len`` tokens (or images) is made.
    loss_fn    ``loss_fn(model, batch) -> scalar``; default ``model(**batch).loss``.
    optimizer  ``adamw``, ``adam``, ``sgd``, ``adafactor`` or a callable ``params -> Optimizer``.
    precision  ``fp32``, ``bf16-mixed``, ``fp16-mixed`` or ``bf16``.
    device     whose semantics to follow: ``cuda`` (the default: ``memfit.cuda``: CUDA autocast lists, fused
               attention, foreach optimizers, cuBLAS workspaces, and the caching allocator's rounding and
               segments, cuDNN's convolution workspaces; the report adds ``reserved_bytes``, ``outside_bytes``
               (the CUDA context and libraries outside the allocator), ``device_bytes`` and a verdict) or ``cpu`` (byte-exact against the CPU allocator). ``None``: CUDA, unless the
               environment sets ``MEMFIT_DEVICE=cpu``.
    gpu        a GPU of the catalog (``"rtx-4090"``, ``memfit.hardware.gpus.gpu(...)``) for CUDA semantics:
               its memory, workspace size and context. Default: the GPU torch sees, else ``h100-sxm``
               (``memfit.hardware.gpus.DEFAULT_GPU``); ``report.settings["target"]`` says which
               (``given``, ``visible``, ``default``, ``cpu``).
    batch_size examples per optimizer step (default 1). With ``recipe.micro_batch_size`` it is
               micro_batch_size x grad_accum_steps; a different value is an error, not overridden.
    budget     CUDA only: the memory the process may use (context included, bytes or "24GiB"),
               enforced as ``torch.cuda.set_per_process_memory_fraction`` would; default the whole
               card. The report's ``verdict`` says whether the step fits (``memfit/estimator/verdict.py``).
    fast       trace a 4-block copy and write its allocation log out at full depth (``depth.py``;
               default: for configs with >= 8 blocks and no explicit batch); ``False`` forces the
               full trace. Per rank it writes out FSDP2's units (a block is one); DDP, an offloaded step
               and a device_map split are traced in full.
    recipe     a :class:`memfit.Recipe` of memory techniques; ``precision`` and ``optimizer`` are
               shorthands for two of its fields. With accumulation, ``batch`` is what one
               optimizer step consumes; a made batch has micro_batch_size x grad_accum_steps rows.
    moe_routing  how a mixture-of-experts router splits tokens, which fake tensors cannot know:
               ``balanced`` (tokens x top_k / experts each) or ``worst`` (all tokens on the same
               top_k experts). Only CPU kernel scratch depends on it (``cpu_kernels.py``).
    progress   ``progress(done, total)``, called as each phase of each trace (forward, backward,
               optimizer of every step, then the replay) begins.
    lengths    per-example token counts (a list, or a ``.txt`` / ``.npy`` / ``.jsonl`` path:
               ``models/lengths.py``) of a Hugging Face causal or masked LM's data. Micro-batches are
               consecutive examples, padded to their longest row (``seq_len`` truncates), or with
               ``packed`` rows of ``seq_len`` packed tokens; the estimate is for the worst micro-batch
               (``report.micro_batch`` says which), every micro-batch of the step having its shape.
    packed     documents concatenated into rows of ``seq_len`` tokens with per-document attention
               (``position_ids`` restarting per document, ``use_cache=False``: transformers' block-causal
               mask); without ``lengths`` every row holds two documents.
    gpus       GPUs per node of a data-parallel run (``recipe.parallel`` ddp or fsdp), ``nodes`` the
               nodes (default 1). The step is one rank's, run by FSDP2 / DDP themselves under PyTorch's
               fake process group (``hardware/cluster.py``); ``batch_size`` is still the examples of one
               optimizer step, over all ranks: each rank's is batch_size / (gpus x nodes). The report is
               the rank with the highest peak; ``report.ranks`` holds each distinct rank's. An explicit
               ``batch`` is one rank's.
    device_map how Accelerate places the model over GPUs, host and disk, as ``from_pretrained`` takes it:
               ``"auto"``, ``"balanced"``, ``"balanced_low_0"``, ``"sequential"`` (transformers' own placement
               of the fake model under ``max_memory``), or a dict of module -> GPU index / "cpu" / "disk"
               (or a .json of one). ``max_memory``: ``{0: "70GB", "cpu": "100GB"}`` or ``"0=70GB,cpu=100GB"``;
               without GPU entries, ``gpus`` (default 1) cards of ``gpu``, each its memory less the CUDA
               context. CUDA semantics (``gpu`` default h100-sxm); the report is the GPU that needs the most,
               ``report.devices`` every device, ``report.device_map`` the placement
               (``techniques/device_map.py``). ``offload_folder``: where modules on "disk" live (required
               when the map puts any there, as from_pretrained requires it).
    workload   ``"train"`` (default: ``steps`` optimizer steps) or ``"forward"``: ``steps`` forwards of the
               model on the batch without gradients (``torch.no_grad``, eval mode), with the recipe's
               precision, attention and quantised weights; the one phase is ``forward``. A model placed
               with ``device_map`` for inference is estimated so.
    """
    check_args(precision, steps, batch_size, seq_len)
    check_switches(fast=fast, packed=packed, progress=progress, loss_fn=loss_fn)
    chosen = target(device, gpu)
    device, gpu = chosen.device, chosen.gpu
    recipe, factory = recipe_from(recipe, precision, optimizer)
    _check_workload(workload, recipe, gpus, nodes)
    model = dataclasses.replace(resolve(model), moe_routing=check_routing(moe_routing))
    recipe, checkpoint = checkpoint_recipe(model, recipe, workload)
    return targeted(chosen, with_checkpoint(model, _estimate_resolved(model, batch, recipe=recipe, factory=factory, loss_fn=loss_fn,
                                              steps=steps, batch_size=batch_size, seq_len=seq_len, device=device,
                                              gpu=gpu, budget=budget, fast=fast, progress=progress, lengths=lengths,
                                              packed=packed, gpus=gpus, nodes=nodes, device_map=device_map,
                                              max_memory=max_memory, offload_folder=offload_folder,
                                              workload=workload, moe_routing=moe_routing), checkpoint))


def targeted(chosen: Target, report: Report) -> Report:
    """``report`` saying whose semantics it followed and why that card (``settings["target"]``; the first line of
    the CLI's answer, ``report.target_line``, says it in words)."""
    return dataclasses.replace(report, settings={**report.settings, "target": chosen.how})


def _estimate_resolved(source, batch, *, recipe, factory, loss_fn, steps, batch_size, seq_len, device, gpu, budget,
                       fast, progress, lengths, packed, gpus, nodes, device_map, max_memory, offload_folder, workload,
                       moe_routing, line: bool = True) -> Report:
    """``estimate`` of a resolved source, once the recipe is final. ``line``: a long accumulation may be read
    off the line through 2 and 3 micro-batches (``_accumulation_line``)."""
    k = recipe.grad_accum_steps
    if line and fast is not False and batch is None and workload == "train" and k > LINE_FROM \
            and recipe.parallel == "none" and recipe.pp == 1 and device_map is None and lengths is None and not packed:
        # (a pipeline's micro-batches are its schedule's: they are all traced)
        args = dict(source=source, batch=batch, factory=factory, loss_fn=loss_fn, steps=steps, seq_len=seq_len,
                    device=device, gpu=gpu, fast=fast, progress=progress, lengths=lengths, packed=packed, gpus=gpus,
                    nodes=nodes, device_map=device_map, max_memory=max_memory, offload_folder=offload_folder,
                    workload=workload, moe_routing=moe_routing)
        micro = step_batch(batch_size, recipe, 1) // k

        def full(r: Recipe, budget=budget, line=False) -> Report:
            return _estimate_resolved(recipe=r, batch_size=micro * r.grad_accum_steps, budget=budget, line=line,
                                      **args)

        return _accumulation_line(full, recipe, resolve_target(device, gpu), _budget(budget, resolve_target(device, gpu)))
    request = None
    if device_map is not None or max_memory is not None or offload_folder is not None:
        request = _placement(recipe, device_map, max_memory, gpus, nodes, fast)
        request["offload_folder"] = offload_folder
        gpus = nodes = None
        if gpu is None and str(device).split(":")[0] == "cpu":
            device = "cuda"
    world = _world(recipe, gpus, nodes)
    target = resolve_target(device, gpu)
    check_gpu(recipe.precision, target)
    budget = _budget(budget, target)
    # the data-parallel ranks split the batch; tensor-parallel peers and pipeline stages read the same rows
    # (context-parallel peers read the same rows too, each a part of their sequence)
    batch_size = step_batch(batch_size, recipe, world.size // (recipe.tp * recipe.pp * recipe.cp) if world else 1)
    if world is not None:
        return _estimate_ranks(source, batch, world, recipe=recipe, loss_fn=loss_fn, factory=factory, steps=steps,
                               batch_size=batch_size, seq_len=seq_len, target=target, budget=budget, fast=fast,
                               progress=progress, moe_routing=moe_routing, lengths=lengths, packed=packed)
    placement = None
    if request is not None:
        from memfit.estimator.placed import placement_of

        placement = placement_of(source, recipe, request, target)
        fast = fast if placement.single else False  # a split step is traced in full
    shapes = [None]
    if lengths is not None or packed:
        shapes = _worst_shapes(source, batch, lengths, packed, recipe, batch_size, seq_len)
    tick = _ticker(progress, len(shapes) * phases(recipe, steps, workload))  # one trace a shape (depth.py: one copy)
    reports = [_estimate(source, batch, recipe=recipe, loss_fn=loss_fn, factory=factory, steps=steps,
                         batch_size=batch_size, seq_len=seq_len, target=target, budget=budget, fast=fast, tick=tick,
                         layout=shape, placement=None if placement is None or placement.single else placement,
                         workload=workload)
               for shape in shapes]
    report = max(reports, key=lambda r: (r.device_bytes, r.peak_bytes))
    if placement is not None and placement.single:
        from memfit.estimator.placed import on_one_gpu

        report = on_one_gpu(report, placement)
    return report


def estimate_micro_batch(model, rows: int, length: int, *, packed: bool = False, ragged: bool = True,
                         **kwargs) -> Report:
    """The estimate of one micro-batch shape of variable-length data: ``rows`` rows of ``length``
    tokens, padded (at least one padding token unless ``ragged=False``) or packed (each row holding
    two documents unless ``ragged=False``); ``kwargs`` as for :func:`estimate` (a ``recipe`` with
    ``grad_accum_steps``: every micro-batch of the step has this shape). For a trainer forming
    token-budget micro-batches: the predicted peak of a shape it may form is ``.peak_bytes``
    (``.device_bytes`` on a GPU)."""
    from memfit.models.lengths import direct

    for name in ("lengths", "packed", "batch", "batch_size", "seq_len"):
        if name in kwargs:
            raise MemfitError(f"estimate_micro_batch takes the shape as rows and length: drop {name}=")
    return estimate(model, lengths=direct(rows, length, packed, ragged), **kwargs)


def _check_workload(workload, recipe: Recipe, gpus, nodes) -> None:
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


def _placement(recipe: Recipe, device_map, max_memory, gpus, nodes, fast) -> dict:
    """``trace``'s placement request, after the checks that need no model."""
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


def _world(recipe: Recipe, gpus, nodes):
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


def _estimate_ranks(model, batch, world, *, recipe, progress, moe_routing, lengths, packed, fast, **kwargs) -> Report:
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
    """``_estimate_ranks``' traces, one fake world a rank, and the report of the worst."""
    from memfit.hardware.cluster import Layout, fake_world
    from memfit.techniques.pipeline_parallel import cut

    layout = Layout.of_recipe(world, recipe)
    reports = []
    # every pipeline stage is its own kind of rank (its blocks, the micro-batches it keeps in flight); TP peers
    # and the data-parallel ranks of a stage hold equal parts
    queue = [layout.rank(pp=s) for s in range(recipe.pp)] if recipe.pp > 1 else [0]
    if recipe.cp > 1:
        # the ring's causal chunks differ by position: the first CP rank runs every later step on half its queries,
        # the last on half the keys; the ranks between mix the two and hold no more than these (bench/distributed.py)
        queue = [layout.rank(shard=0), layout.rank(shard=recipe.cp - 1)]
    parts = cut(source.depth, recipe.pp) if recipe.pp > 1 and source.depth else None
    for rank in queue:  # grows while it is read: the last rank of a stage whose parameters split unevenly
        with fake_world(world, rank) as place:
            tick = _ticker(progress, phases(recipe, kwargs["steps"]))
            stage = layout.coords(rank)["pp"]
            report = _estimate(source, batch, recipe=recipe, fast=fast, tick=tick, layout=None,
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


def _accumulation_line(full, r: Recipe, target, budget) -> Report:
    """The estimate of ``r``'s k > LINE_FROM micro-batches per step from traces of 2 and 3.

    Micro-batches 2..k hold the same tensors but a few scalars (loss weights) and their rows of the
    batch, so the peak grows by the same bytes with each: traced at 2 and 3, read at k (never below
    tracing all k, within 0.1 %: tests/test_plan.py). On a GPU the line's reserved figure is judged
    without events (``fit_reserved``); near or past the limit the line cannot say what torch does there
    (free and retry, expandable segments), so up to FULL_ACCUMULATION micro-batches are traced and
    replayed; past that the line's verdict stands.
    """
    k = r.grad_accum_steps
    two, three = full(r.replace(grad_accum_steps=2), None), full(r.replace(grad_accum_steps=3), None)

    def line(a, b):
        return None if a is None else b + (b - a) * (k - 3)

    peak = line(two.peak_bytes, three.peak_bytes)
    cuda = {}
    if target is not None:
        from memfit.estimator.verdict import FITS, fit_reserved

        def demand(report):  # on out of memory: what it held at the limit and what was missing
            return report.reserved_bytes + (report.missing_bytes or 0)

        cuda = fit_reserved(peak, line(demand(two), demand(three)), target, budget,
                            (three.managed_bytes or 0, three.managed_resident_bytes or 0)).report_fields()
        if (cuda["verdict"] != FITS or cuda["tight"]) and k <= FULL_ACCUMULATION:
            return full(r)
    rows = three.settings.get("batch_shapes") or []
    shapes = [[shape[0] * k // 3, *shape[1:]] if shape else shape for shape in rows]
    return dataclasses.replace(
        three, **{"peak_bytes": peak, **cuda}, settings={**three.settings, "recipe": r.to_dict(), "batch_shapes": shapes},
        step_peaks=[line(a, b) for a, b in zip(two.step_peaks, three.step_peaks)],
        phase_peaks={p: line(two.phase_peaks[p], v) for p, v in three.phase_peaks.items() if p in two.phase_peaks},
        notes=three.notes + [f"accumulation traced over 2 and 3 micro-batches and read at {k} (fast=False or --full "
                             "traces every one)"])


def _worst_shapes(source, batch, lengths, packed: bool, recipe: Recipe, batch_size: int, seq_len):
    """The micro-batch shapes of ``lengths`` one of which is the worst (``lengths.worst_shapes``)."""
    from memfit.models.lengths import MicroBatch, direct, micro_batches, read_lengths, worst_shapes

    if isinstance(lengths, MicroBatch):  # estimate_micro_batch's shape
        return [lengths]
    if batch is not None:
        raise MemfitError("lengths= and packed= make the batch: drop batch=, or pass your own padded or packed batch "
                          "without them")
    rows, rest = divmod(batch_size, recipe.grad_accum_steps)
    if rest:
        raise MemfitError(f"grad_accum_steps={recipe.grad_accum_steps} does not divide batch_size={batch_size}: "
                          "pick a divisor")
    if lengths is None:  # packed rows, each of two documents
        if seq_len is None:
            raise MemfitError("packed=True needs seq_len: the tokens of one packed row")
        return [direct(rows, seq_len, True, True)]
    return worst_shapes(micro_batches(read_lengths(lengths), rows, packed=packed, seq_len=seq_len))


def _estimate(source, batch, *, recipe, loss_fn, factory, steps, batch_size, seq_len, target, budget, fast, tick,
              layout, placement=None, workload: str = "train", stage=None) -> Report:
    """One estimate: the depth fast path or a full trace; with ``layout``, of that micro-batch shape; with ``stage``
    (a pipeline stage and its blocks), of that stage's rank."""
    if layout is not None:
        batch_size = layout.rows * recipe.grad_accum_steps
        if recipe.micro_batch_size and recipe.micro_batch_size != layout.rows:  # a last, shorter micro-batch
            recipe = recipe.replace(micro_batch_size=layout.rows)
    if fast and recipe.compile:
        raise MemfitError("fast=True and compile conflict: a compiled step has no per-block records for the depth "
                          "fast path to write out; leave fast unset (compiled steps are traced in full)")
    if fast is None:
        fast = (source.config is not None and batch is None and (source.depth or 0) >= FAST_MIN_DEPTH
                and not recipe.compile)  # compiled code runs outside the blocks' records: in full
    if fast and batch is None and source.config is not None and source.depth:  # else nothing to scale: traced in full
        from memfit.estimator.depth import estimate_by_depth

        report = estimate_by_depth(source, recipe=recipe, loss_fn=loss_fn, optimizer=factory, steps=steps,
                                   batch_size=batch_size, seq_len=seq_len, gpu=target, budget=budget, tick=tick,
                                   layout=layout, workload=workload, stage=stage)
    else:
        report, _ = fake_trace(source, batch, recipe=recipe, loss_fn=loss_fn, optimizer=factory, steps=steps,
                               batch_size=batch_size, seq_len=seq_len, gpu=target, budget=budget, tick=tick,
                               layout=layout, placement=placement, workload=workload)
    if layout is None:
        return report
    return dataclasses.replace(report, micro_batch=layout.summary(), notes=report.notes + [_shape_note(layout)])


def _shape_note(shape) -> str:
    kind = "packed" if shape.packed else "padded"
    where = (f"micro-batch {shape.index + 1} of {shape.count}, the worst the lengths make: "
             if shape.index is not None else "")
    mask = (("rows of two or more documents: transformers builds a block-causal mask per forward"
             if shape.packed else "padding: transformers builds a 4-D mask per forward")
            if shape.ragged else "no padding or document boundary: runs as a dense batch, no mask")
    tokens = f", {shape.tokens:,} real tokens" if shape.tokens is not None else ""
    return f"{where}{shape.rows} {kind} row(s) of {shape.length} tokens{tokens}; {mask}"


def _ticker(progress, total: int):
    """A ``tick()`` that reports ``progress(done, total)``; None without a progress callable."""
    if progress is None:
        return None
    done = 0
    progress(done, total)

    def tick():
        nonlocal done
        done = min(done + 1, total)
        progress(done, total)

    return tick


def resolve_target(device, gpu):
    """None for CPU semantics, else the catalog GPU whose CUDA semantics to follow."""
    from memfit.hardware.gpus import GPU, gpu as lookup

    kind = str(device).split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise MemfitError(f"device {device!r} is not modelled: use device='cpu' or device='cuda'")
    if gpu is None:
        return lookup(DEFAULT_GPU) if kind == "cuda" else None
    return gpu if isinstance(gpu, GPU) else lookup(gpu)


def _budget(budget, target):
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


def check_args(precision: str, steps: int, batch_size: int | None, seq_len: int | None) -> None:
    check_precision(precision)
    for name, value, limit in (("steps", steps, MAX_STEPS), ("batch_size", batch_size, MAX_BATCH),
                               ("seq_len", seq_len, MAX_SEQ)):
        if (value is not None or name == "steps") and (not isinstance(value, int) or isinstance(value, bool)
                                                       or not 0 < value <= limit):
            raise MemfitError(f"{name} must be an integer from 1 to {limit}, got {shown(value)}")


def check_switches(**values) -> None:
    """Keyword switches of the API that take True/False (None: the default) or a callable (None: none):
    ``fast="yes"`` or ``progress=3`` is one line here, not a TypeError deep in the trace or a silent truthy."""
    for name, value in values.items():
        if name in ("progress", "loss_fn"):
            if value is not None and not callable(value):
                raise MemfitError(f"{name} must be a callable or None, got {type(value).__name__} {shown(value, 40)}")
        elif value is not None and not isinstance(value, bool):
            raise MemfitError(f"{name} must be True or False, got {type(value).__name__} {shown(value, 40)}")


# Bounds past which a trace would run for hours (steps) or byte counts overflow 64 bits.
MAX_STEPS = 64
MAX_SEQ = 1 << 24


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
