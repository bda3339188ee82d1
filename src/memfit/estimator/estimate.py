"""``estimate``: the memory of training steps, computed on fake tensors.

The user's step runs unchanged under ``FakeTensorMode``: every op computes shapes and dtypes
only, so a 70B model costs no memory and no GPU. Measured on CPU, the result matches the
allocator to the byte where nothing is hidden inside kernels; kernel scratch is replayed per op
(``accounting/scratch.py``). For deep Hugging Face models a fast path traces two shallow copies
and scales by depth (``depth.py``).

This module is the entry and the dispatch: it resolves the arguments (``checks.py``; where the step
runs and what it runs on, ``inputs.py``), then sends the step to one trace (``traced.py``), one per
micro-batch shape of variable-length data (``shapes.py``), one per kind of rank (``sharded.py``), or two
read off a line for a long accumulation (``accumulation_line.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from memfit.errors import MemfitError
from memfit.estimator.accumulation_line import FULL_ACCUMULATION, LINE_FROM, accumulation_line
from memfit.estimator.checkpoint import checkpoint_recipe, with_checkpoint
from memfit.estimator.checks import (MAX_SEQ, MAX_STEPS, budget_bytes, check_args, check_switches, check_workload,
                                     placement_request, recipe_world, resolve_target, step_batch)
from memfit.estimator.inputs import Data, Hardware, gather
from memfit.estimator.rebudget import spoil
from memfit.estimator.shapes import worst_shapes
from memfit.estimator.sharded import estimate_ranks
from memfit.estimator.trace import phases
from memfit.estimator.traced import FAST_MIN_DEPTH, ticker, traced
from memfit.hardware.cpu_kernels import check_routing
from memfit.hardware.gpus import DEFAULT_GPU, Target, target
from memfit.models.source import resolve
from memfit.report.report import Report
from memfit.techniques.precision import check_gpu
from memfit.techniques.recipe import Recipe, recipe_from

# estimate, its one-shape form and its verdict's wording; the rest is importable here as it was before the split
__all__ = ["estimate", "estimate_micro_batch", "targeted", "Hardware", "Data", "resolve_target", "DEFAULT_GPU",
           "check_args", "check_switches", "step_batch", "MAX_SEQ", "MAX_STEPS", "FAST_MIN_DEPTH", "LINE_FROM",
           "FULL_ACCUMULATION"]


def estimate(model, batch=None, *, hardware: Hardware | None = None, data: Data | None = None, loss_fn=None,
             optimizer="adamw", precision: str = "fp32", steps: int = 2, fast: bool | None = None,
             recipe: Recipe | None = None, moe_routing: str = "balanced", progress=None, device_map=None,
             max_memory=None, offload_folder: str | None = None, workload: str = "train",
             batch_size: int | None = None, seq_len: int | None = None, lengths=None, packed: bool = False,
             device: str | None = None, gpu=None, budget=None, gpus: int | None = None,
             nodes: int | None = None) -> Report:
    """Estimate the memory of ``steps`` training steps without allocating it.

        memfit.estimate("llama-3.2-1b", hardware=memfit.Hardware(gpu="rtx-4090", budget="20GiB"),
                        data=memfit.Data(batch_size=8, seq_len=2048), precision="bf16-mixed")

    hardware   where the step runs, a :class:`memfit.Hardware`: its fields ``device``, ``gpu``,
               ``budget``, ``gpus`` and ``nodes`` are described below, and each may be given as a
               keyword of that name instead (a keyword that differs from ``hardware``'s field is an error).
    data       what the step runs on, a :class:`memfit.Data`: ``batch_size``, ``seq_len``, ``lengths``
               and ``packed`` below, each also a keyword of that name.
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
    hardware, data = gather(hardware, data, gpu=gpu, device=device, budget=budget, gpus=gpus, nodes=nodes,
                            batch_size=batch_size, seq_len=seq_len, lengths=lengths, packed=packed)
    check_args(precision, steps)
    check_switches(fast=fast, progress=progress, loss_fn=loss_fn)
    chosen = target(hardware.device, hardware.gpu)
    hardware = dataclasses.replace(hardware, device=chosen.device, gpu=chosen.gpu)
    recipe, factory = recipe_from(recipe, precision, optimizer)
    check_workload(workload, recipe)
    model = dataclasses.replace(resolve(model), moe_routing=check_routing(moe_routing))
    recipe, checkpoint = checkpoint_recipe(model, recipe, workload)
    step = _Step(factory, loss_fn, steps, fast, progress, workload, moe_routing, device_map, max_memory, offload_folder)
    return targeted(chosen, with_checkpoint(model, _estimate_resolved(model, batch, recipe, hardware, data, step),
                                            checkpoint))


def targeted(chosen: Target, report: Report) -> Report:
    """``report`` saying whose semantics it followed and why that card (``settings["target"]``; the first line of
    the CLI's answer, ``report.target_line``, says it in words)."""
    return dataclasses.replace(report, settings={**report.settings, "target": chosen.how})


@dataclass(frozen=True)
class _Step:
    """The step's own settings, as ``estimate`` checked them: the same for every trace one call makes."""

    factory: object  # the optimizer callable, or None for the recipe's optimizer
    loss_fn: object
    steps: int
    fast: bool | None
    progress: object
    workload: str
    moe_routing: str
    device_map: object
    max_memory: object
    offload_folder: str | None

    @property
    def placed(self) -> bool:
        return self.device_map is not None or self.max_memory is not None or self.offload_folder is not None


def _estimate_resolved(source, batch, recipe: Recipe, hardware: Hardware, data: Data, step: _Step,
                       line: bool = True) -> Report:
    """``estimate`` of a resolved source, once the recipe is final. ``line``: a long accumulation may be read
    off the line through 2 and 3 micro-batches (``accumulation_line``)."""
    k = recipe.grad_accum_steps
    if line and step.fast is not False and batch is None and step.workload == "train" and k > LINE_FROM \
            and recipe.parallel == "none" and recipe.pp == 1 and not step.placed and data.lengths is None \
            and not data.packed:
        # (a pipeline's micro-batches are its schedule's: they are all traced)
        micro = step_batch(data.batch_size, recipe, 1) // k

        def full(r: Recipe, budget=hardware.budget, line=False) -> Report:
            return _estimate_resolved(source, batch, r, dataclasses.replace(hardware, budget=budget),
                                      dataclasses.replace(data, batch_size=micro * r.grad_accum_steps), step, line)

        where = resolve_target(hardware.device, hardware.gpu)
        spoil("accumulation read off a line")
        return accumulation_line(full, recipe, where, budget_bytes(hardware.budget, where))
    request = None
    gpus, nodes, device = hardware.gpus, hardware.nodes, hardware.device
    if step.placed:
        request = placement_request(recipe, step.device_map, step.max_memory, gpus, nodes, step.fast)
        request["offload_folder"] = step.offload_folder
        gpus = nodes = None
        if hardware.gpu is None and str(device).split(":")[0] == "cpu":
            device = "cuda"
    world = recipe_world(recipe, gpus, nodes)
    where = resolve_target(device, hardware.gpu)
    check_gpu(recipe.precision, where)
    # the data-parallel ranks split the batch; tensor-parallel peers and pipeline stages read the same rows
    # (context-parallel peers read the same rows too, each a part of their sequence)
    ranks = world.size // (recipe.tp * recipe.pp * recipe.cp) if world else 1
    trace = dict(recipe=recipe, loss_fn=step.loss_fn, factory=step.factory, steps=step.steps,
                 batch_size=step_batch(data.batch_size, recipe, ranks), seq_len=data.seq_len, target=where,
                 budget=budget_bytes(hardware.budget, where))
    if world is not None:
        spoil("a multi-rank estimate")
        return estimate_ranks(source, batch, world, progress=step.progress, moe_routing=step.moe_routing,
                              lengths=data.lengths, packed=data.packed, fast=step.fast, **trace)
    return _on_one_process(source, batch, request, data, step, trace)


def _on_one_process(source, batch, request, data: Data, step: _Step, trace: dict) -> Report:
    """One device's estimate, or one process's over the devices of a ``device_map``: a trace per micro-batch
    shape the data makes (one without ``lengths`` or ``packed``), the worst reported."""
    placement, fast = None, step.fast
    if request is not None:
        from memfit.estimator.placed import placement_of

        spoil("a device_map placement")
        placement = placement_of(source, trace["recipe"], request, trace["target"])
        fast = fast if placement.single else False  # a split step is traced in full
    shapes = [None]
    if data.lengths is not None or data.packed:
        shapes = worst_shapes(source, batch, data.lengths, data.packed, trace["recipe"], trace["batch_size"],
                              data.seq_len)
    # one trace a shape (depth.py: one copy)
    tick = ticker(step.progress, len(shapes) * phases(trace["recipe"], step.steps, step.workload))
    reports = [traced(source, batch, fast=fast, tick=tick, layout=shape, workload=step.workload,
                      placement=None if placement is None or placement.single else placement, **trace)
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

    for name in ("lengths", "packed", "batch", "batch_size", "seq_len", "data"):
        if name in kwargs:
            raise MemfitError(f"estimate_micro_batch takes the shape as rows and length: drop {name}=")
    return estimate(model, lengths=direct(rows, length, packed, ragged), **kwargs)
