"""Data parallelism: PyTorch's FSDP2 (``fully_shard``) or DDP over the ranks of a ``World``.

``parallel=fsdp`` shards every repeated block with ``fully_shard``, then the root, as torchtitan
and torchtune wrap. Each rank keeps 1/N of the parameters, their gradients and the optimizer state;
a unit's full parameters exist only between its all-gather and its reshard. Memory per rank: the
shards, plus the unsharded parameters of the running unit (and the one prefetched), plus the
unsharded gradients of a unit until its reduce-scatter. ``reshard_after_forward``: ``true`` frees a
unit's full parameters after its forward and gathers them again in backward (ZeRO-3-like); ``false``
keeps them from forward to backward (ZeRO-2-like: no second all-gather, more memory); an integer N
reshards to groups of N ranks (FSDP2's partial resharding). ``mixed_precision`` is FSDP2's
``MixedPrecisionPolicy``: the all-gathered (compute) parameters in ``param`` dtype, gradients reduced
in ``reduce`` dtype, the shards and optimizer state staying fp32. Across nodes the mesh is 2-D and
the blocks are sharded within a node and replicated between nodes (HSDP); ``shard_over=world`` shards
over every rank of every node instead (1/size each, all-gathers over the network).

Under CUDA semantics each allocation carries its stream (``Record.stream``): FSDP2 gathers on its
copy-in stream (implicit prefetching) and reduce-scatters into buffers of its reduce-scatter stream,
and the caching allocator keeps a pool per stream (``_fsdp_roles``).

``offload`` is FSDP2's ``CPUOffloadPolicy``: the shards, their gradients and the optimizer state live
in host memory (pinned by default) and the optimizer steps there; each unit's shard is copied to the
GPU for its all-gather and each sharded gradient back after its reduce-scatter. The GPU then holds
the gathered units, activations and buffers; the host the rest (``host_records``).

``parallel=ddp`` is ``DistributedDataParallel``: every rank holds the whole model and its
optimizer state, plus the reducer's gradient buckets (one copy of the trainable parameters).

With accumulation, ``sync_grads=last`` (default) skips the gradient reduction of every micro-batch
but the last (``set_requires_gradient_sync(False)``; DDP's ``no_sync``): under FSDP2 each unit then
keeps its unsharded gradients until the last micro-batch. ``every`` reduce-scatters after each one.

``construction`` says how an FSDP2 model came to be sharded: ``meta`` (default) built on the meta device,
sharded, then materialised (``to_empty``), as torchtitan does: a rank never holds the whole model and
the construction is not part of the figures; ``host`` built whole in each rank's host memory, then
sharded onto the GPU, as simple scripts do: the GPU as with ``meta``, the host the whole model per
rank while it is sharded (``host_bytes``); ``device`` built whole on the GPU (``model.cuda()``), then
sharded: the construction is traced with the step, and its peak (the whole model plus the shards made
so far) counts.

``pp=N``, ``tp=N``, ``ep=N`` and ``cp=N`` (``pipeline_parallel.py``, ``tensor_parallel.py``,
``expert_parallel.py``, ``context_parallel.py``) run on one device mesh of the world, ``hardware.cluster.Layout``'s
pp x replicate x shard x tp (torchtitan's order; ep and cp split ``shard``): the stage is cut first, its blocks
split over the TP group, then FSDP2 shards it over the data-parallel dimensions.

Does not combine with (yet, each one error): chunked_loss (its head runs outside the root's
forward, on resharded weights), compile, qlora and 8/4-bit optimizers (bitsandbytes does not take
DTensors), offload_optimizer and optimizer_in_backward.
"""

from __future__ import annotations

import contextlib
import re
import warnings

from memfit.errors import MemfitError, shown
from memfit.techniques.spec import Field, Technique
from memfit.techniques.context_parallel import ROTATE, check_cp, context_parallel, cp_conflict
from memfit.techniques.expert_parallel import check_ep, ep_conflict, expert_parallel, shard_experts
from memfit.techniques.tensor_parallel import check_tp, tensor_parallel, tp_conflict
from memfit.techniques.pipeline_parallel import SCHEDULES, check_pp, pipeline, pipeline_conflict

__all__ = ["TECHNIQUE", "reshard_value", "mixed_dtypes", "PARALLEL", "OFFLOAD", "CONSTRUCTION", "host_records"]

PARALLEL = ("none", "ddp", "fsdp")
OFFLOAD = ("none", "cpu", "cpu-unpinned")
CONSTRUCTION = ("meta", "host", "device")
#: optimizers whose step runs only on a GPU (bitsandbytes, torchao kernels): not on an offloaded host
_DEVICE_ONLY = ("8bit", "4bit", "paged", "fp8")
_DTYPES = ("bf16", "fp16", "fp32")


def reshard_value(value) -> bool | int:
    """``reshard_after_forward`` as FSDP2 takes it: True, False or a group size >= 2."""
    text = str(value).strip().lower()
    if text in ("true", "false"):
        return text == "true"
    if re.fullmatch(r"[0-9]{1,6}", text) and int(text) >= 2:
        return int(text)
    raise MemfitError(f"reshard_after_forward {shown(value)} not understood: use true (ZeRO-3-like), false "
                      "(ZeRO-2-like) or a group size N >= 2 that divides the GPUs per node")


def _check_reshard(value) -> None:
    reshard_value(value)


def mixed_dtypes(value) -> tuple | None:
    """(param dtype, reduce dtype) names of a ``mixed_precision`` value; None for ``none``."""
    text = str(value).strip().lower()
    if text == "none":
        return None
    parts = text.split(":")
    if len(parts) <= 2 and all(p in _DTYPES for p in parts) and parts[0] != "fp32":
        return parts[0], parts[-1]
    raise MemfitError(f"mixed_precision {shown(value)} not understood: use none, bf16, bf16:fp32 (compute "
                      "dtype[:reduce dtype]), fp16 or fp16:fp32")


def _check_mixed(value) -> None:
    mixed_dtypes(value)


_INCOMPATIBLE = (("chunked_loss", lambda r: bool(r.chunked_loss)),
                 ("compile", lambda r: bool(r.compile)),
                 ("offload_optimizer", lambda r: bool(r.offload_optimizer)),
                 ("optimizer_in_backward", lambda r: bool(r.optimizer_in_backward)),
                 ("lora", lambda r: str(r.lora).startswith("qlora")),
                 ("optimizer", lambda r: any(k in str(r.optimizer) for k in ("8bit", "4bit", "paged"))))


def _conflicts(recipe):
    clash = pipeline_conflict(recipe)
    if clash:
        yield clash
        return
    for name in ("sequence_parallel", "loss_parallel"):
        if getattr(recipe, name) and recipe.tp == 1:
            yield f"{name}=true needs tensor parallelism: set tp to 2 or more (or drop {name})"
            return
    if recipe.tp > 1:
        clash = tp_conflict(recipe)
        if clash:
            yield clash
            return
    if recipe.ep > 1:
        clash = ep_conflict(recipe)
        if clash:
            yield clash
            return
    clash = cp_conflict(recipe)
    if clash:
        yield clash
        return
    if recipe.offload != "none":
        if recipe.parallel != "fsdp":
            yield (f"offload={recipe.offload} and parallel={recipe.parallel} conflict: offload is FSDP2's "
                   "CPUOffloadPolicy; set parallel=fsdp (at any number of GPUs, 1 included)")
            return
        if any(k in str(recipe.optimizer) for k in _DEVICE_ONLY):
            yield (f"offload={recipe.offload} and optimizer={recipe.optimizer} conflict: with offload the optimizer "
                   "steps on the host, and that optimizer's kernels run on a GPU only; use adamw (or adam, sgd)")
            return
    if recipe.parallel != "fsdp" and recipe.construction != "meta":
        yield (f"construction={recipe.construction} and parallel={recipe.parallel} conflict: construction says how "
               "FSDP2 shards a model; set parallel=fsdp")
        return
    if recipe.parallel != "fsdp" and recipe.shard_over != "node":
        yield (f"shard_over={recipe.shard_over} and parallel={recipe.parallel} conflict: shard_over is FSDP2's mesh; "
               "set parallel=fsdp")
        return
    if recipe.parallel == "none":
        for name in ("reshard_after_forward", "mixed_precision", "sync_grads"):
            default = next(f.default for f in TECHNIQUE.fields if f.name == name)
            if getattr(recipe, name) != default:
                yield f"{name}={getattr(recipe, name)} needs parallel=fsdp (or ddp for sync_grads): set parallel"
        return
    for name, clashes in _INCOMPATIBLE:
        if clashes(recipe):
            yield (f"parallel={recipe.parallel} and {name}={getattr(recipe, name)} conflict: memfit has not checked "
                   f"that pair against real runs yet; drop {name}")
    if recipe.parallel == "ddp":
        for name in ("reshard_after_forward", "mixed_precision"):
            default = next(f.default for f in TECHNIQUE.fields if f.name == name)
            if getattr(recipe, name) != default:
                yield f"parallel=ddp and {name}={getattr(recipe, name)} conflict: {name} is FSDP2's; use parallel=fsdp"
    dtypes = mixed_dtypes(recipe.mixed_precision)
    # autocast over FSDP2's policy of the same dtype is what accelerate (and so the Trainer) runs with FSDP2 and
    # mixed_precision bf16/fp16; any other pair is one or the other
    if dtypes and recipe.precision != "fp32" and recipe.precision != f"{dtypes[0]}-mixed":
        yield (f"mixed_precision={recipe.mixed_precision} and precision={recipe.precision} conflict: FSDP2's policy "
               f"casts the gathered parameters itself; keep precision=fp32 (or {dtypes[0]}-mixed: autocast over the "
               "policy, as accelerate runs it)")


def _apply(build) -> None:
    recipe = build.recipe
    if recipe.parallel == "none" and recipe.tp == 1 and recipe.pp == 1:
        return
    from memfit.hardware.cluster import placement

    place = placement()
    if recipe.pp > 1 or recipe.tp > 1 or recipe.ep > 1 or recipe.cp > 1:
        place = _mesh_parallel(build, place)  # this rank's data-parallel ranks
        if recipe.parallel == "none":
            build.watch.settle()
            return
    if recipe.parallel == "fsdp":
        _shard(build, place)
    else:
        _replicate(build, place)
    if recipe.parallel == "fsdp":
        build.step_contexts.append(lambda: _fsdp_roles(build.watch))
    if recipe.grad_accum_steps > 1 and recipe.sync_grads == "last":
        build.before_micro.append(_sync_last if recipe.parallel == "fsdp" else _ddp_sync_last)
    if recipe.construction != "device":  # built on the GPU: the whole model and its sharding are seen
        build.watch.settle()  # construction (sharding, DDP's buckets) is before the step


def _mesh_parallel(build, place):
    """Pipeline and tensor parallelism on one mesh of the world (``Layout``: pp x replicate x shard x tp): the
    stage is cut from the model, then its blocks are split over the TP group. Returns the placement FSDP2 or
    DDP then uses: the data-parallel ranks that hold the same part."""
    import dataclasses

    from memfit.hardware.cluster import Layout, World

    recipe = build.recipe
    layout = Layout.of_recipe(place.world, recipe)
    mesh = layout.device_mesh(place.mesh.device_type)
    if recipe.pp > 1:
        pipeline(build, mesh)
    if recipe.tp > 1:
        tensor_parallel(build, mesh)
    if recipe.ep > 1:
        expert_parallel(build, mesh)
    if recipe.cp > 1:
        context_parallel(build, mesh)
    dp = Layout.data_parallel(mesh)
    return dataclasses.replace(place, world=World(layout.shard, layout.replicate), mesh=dp, flat=dp)


def _shard(build, place) -> None:
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    recipe = build.recipe
    reshard = reshard_value(recipe.reshard_after_forward)
    shards = (place.mesh if recipe.shard_over == "node" else place.flat).shape[-1]
    if isinstance(reshard, int) and not isinstance(reshard, bool) and shards % reshard:
        raise MemfitError(f"reshard_after_forward={reshard} does not divide the {shards} GPUs FSDP2 shards over: "
                          "pick a divisor, or true / false")
    dtypes = mixed_dtypes(recipe.mixed_precision)
    names = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    policy = (MixedPrecisionPolicy(param_dtype=names[dtypes[0]], reduce_dtype=names[dtypes[1]]) if dtypes
              else MixedPrecisionPolicy())
    # pinning needs a GPU: a fake estimate on a CPU build shards unpinned, and reports the pinned bytes
    offload = (CPUOffloadPolicy(pin_memory=recipe.offload == "cpu" and not place.fake) if recipe.offload != "none"
               else OffloadPolicy())
    with _mesh_outside_fake():
        _fully_shard(build, place, reshard, policy, offload)


def _fully_shard(build, place, reshard, policy, offload) -> None:
    import torch
    from torch.distributed.fsdp import fully_shard

    from memfit.techniques.checkpointing import find_blocks

    mesh = place.mesh if build.recipe.shard_over == "node" else place.flat
    shards = mesh.shape[-1]
    uneven = next((name for name, p in build.model.named_parameters() if p.dim() and p.shape[0] % shards), None)
    if uneven is not None:
        place.notes["uneven"] = uneven  # the last rank's shards are smaller: estimate.py traces it too
    # a rank's pipeline stages under a looped schedule each run on their own: each is a root, as torchtitan
    # shards each model part (a root's all-gather runs in its own forward)
    stages = getattr(build.model, "stages", None)
    for root in (list(stages) if isinstance(stages, torch.nn.ModuleList) else [build.model]):
        blocks = _units(root, find_blocks(root))
        for experts in getattr(build, "experts", ()):  # expert parallel: each MoE layer's experts on their own
            shard_experts(experts, build, reshard, policy, offload)
        for _, block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy, offload_policy=offload)
        # The root (embeddings, head, final norm) takes FSDP2's default: kept gathered from forward to
        # backward (its backward comes first), as torchtitan and torchtune leave it.
        fully_shard(root, mesh=mesh, reshard_after_forward=None if blocks else reshard, mp_policy=policy,
                    offload_policy=offload)


def _units(model, blocks) -> list:
    """The blocks FSDP2 wraps on their own: the repeated ones (a model's ``_no_split_modules`` may name
    one-off modules, BERT's embeddings), less any holding a parameter tied to another module (a tied
    weight must be in one FSDP group: it stays with the root)."""
    from collections import Counter

    kinds = Counter(type(block) for _, block in blocks)
    seen = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return [(name, block) for name, block in blocks if kinds[type(block)] > 1
            and not any(seen[id(p)] > 1 for p in block.parameters())]


@contextlib.contextmanager
def _mesh_outside_fake():
    """FSDP2 makes the smaller mesh of a partial reshard (``reshard_after_forward=N``) inside
    ``fully_shard``, from the mesh's rank tensor: under ``FakeTensorMode`` that real tensor is
    refused, so that one function runs with the fake mode lifted (it allocates no parameter)."""
    import torch.distributed.fsdp._fully_shard._fully_shard as module
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes

    from memfit.scoped import patched

    from torch.distributed.device_mesh import DeviceMesh

    made = getattr(module, "_get_post_forward_mesh_info", None)
    joined = DeviceMesh.__dict__.get("_concatenate")  # with TP: the 2-D (dp, tp) mesh of each DTensor shard
    if made is None:  # another torch: nothing to lift
        yield
        return

    def outside(*args, **kwargs):
        with unset_fake_temporarily():
            return made(*args, **kwargs)

    def concatenate(meshes):
        # every mode lifted, the ledger's too: the slice finds this rank's row with nonzero() (row 0 under them)
        with _disable_current_modes():
            return joined.__func__(meshes)

    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(module, "_get_post_forward_mesh_info", outside))
        if isinstance(joined, staticmethod):
            stack.enter_context(patched(DeviceMesh, "_concatenate", staticmethod(concatenate)))
        stack.enter_context(_lazy_chunks())
        yield


class _Chunks:
    """``_chunk_with_empty(tensor, n, dim)`` as FSDP2 reads it, one chunk at a time (see ``_lazy_chunks``)."""

    def __init__(self, tensor, n: int, dim: int):
        self.tensor, self.n, self.dim = tensor, n, dim
        self.size = -(-tensor.shape[dim] // n)  # torch.chunk's chunk size: the 0th is always full

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if not -self.n <= i < self.n:
            raise IndexError(i)
        start = (i % self.n) * self.size
        length = min(self.size, self.tensor.shape[self.dim] - start)
        return self.tensor.narrow(self.dim, start, length) if length > 0 else self.tensor.new_empty(0)


@contextlib.contextmanager
def _lazy_chunks():
    """FSDP2's ``fully_shard`` splits every parameter into one chunk per rank and reads two of them (this
    rank's and the 0th). Under a fake world of thousands of ranks that is thousands of dispatched views and
    empties per parameter (a 2-layer model at 4,096 ranks: a minute; a 70B model's 724 parameters: hours),
    so while it shards, the chunks are made when read: the same views (``narrow`` is what ``chunk``
    returns), the same empty tensor past the last, nothing allocated either way."""
    import torch.distributed.fsdp._fully_shard._fsdp_param as module

    from memfit.scoped import patched

    made = getattr(module, "_chunk_with_empty", None)
    if made is None:  # another torch: chunked as it chunks
        yield
        return

    def lazy(tensor, num_chunks: int, dim: int):
        if num_chunks <= 64 or tensor.dim() == 0 or tensor.shape[dim] == 0:
            return made(tensor, num_chunks, dim)
        return _Chunks(tensor, num_chunks, dim)

    with patched(module, "_chunk_with_empty", lazy):
        yield


@contextlib.contextmanager
def _fsdp_roles(watch):
    """Labels FSDP2's own tensors while a step runs: gathered parameters, gradients before their
    reduce-scatter, and the all-gather / reduce-scatter buffers (``categories.py``). FSDP2 has no
    hooks for these, so three of its private functions are wrapped for the step, as torch's own
    ``FSDPMemTracker`` does; where a torch lacks one, its tensors stay temporaries (bytes unchanged)."""
    import torch

    from memfit.categories import Category
    from memfit.hardware.cuda import active as cuda_active
    from memfit.scoped import patched

    try:
        import torch.distributed.fsdp._fully_shard._fsdp_param as param_module
        import torch.distributed.fsdp._fully_shard._fsdp_param_group as group_module
    except ImportError:  # pragma: no cover
        yield
        return
    gather, reduce = getattr(group_module, "foreach_all_gather", None), getattr(group_module, "foreach_reduce", None)
    init = getattr(getattr(param_module, "FSDPParam", None), "init_unsharded_param", None)
    if gather is None or reduce is None or init is None:
        yield
        return

    streams = getattr(watch, "on_stream", None)  # a ledger; the truth's watch labels nothing

    def all_gather(*args, **kwargs):
        # implicit prefetching (not async_op) copies in and gathers on FSDP2's own streams
        async_op = args[2] if len(args) > 2 else kwargs.get("async_op", False)
        with streams(0 if async_op else COPY_IN_STREAM) if streams else contextlib.nullcontext():
            result = gather(*args, **kwargs)
        if result is not None:
            watch.mark(result[0], Category.COMMUNICATION)
        return result

    def reduce_scatter(fsdp_params, unsharded_grads, *args, **kwargs):
        for grad in unsharded_grads:  # foreach_reduce empties the list
            watch.mark(grad, Category.UNSHARDED_GRADIENTS)
        with contextlib.ExitStack() as scope:
            comm = args[2] if len(args) > 2 else kwargs.get("reduce_scatter_comm")
            if streams is not None and comm is not None and hasattr(comm, "allocate"):
                scope.enter_context(_reduce_streams(comm, watch))
            result = reduce(fsdp_params, unsharded_grads, *args, **kwargs)
        watch.mark(result[0], Category.COMMUNICATION)
        return result

    inputs = getattr(param_module.FSDPParam, "all_gather_inputs", None)
    staged = streams is not None and isinstance(inputs, property) and cuda_active()

    def all_gather_inputs(self):
        # CPUOffloadPolicy on a GPU: each shard is copied to the GPU (``.to(device, non_blocking=True)``, on the
        # copy-in stream) and cast to the compute dtype there; the copy lives until the cast is made. The fake
        # step runs on the host, where that ``.to`` is a no-op: the copy is allocated here instead.
        if not self.offload_to_cpu:
            return inputs.fget(self)
        copy = torch.empty_like(self._sharded_param_data)
        out = inputs.fget(self)
        del copy
        return out

    def unsharded(self):
        init(self)
        for tensor in (getattr(self, "_unsharded_param", None), *getattr(self, "all_gather_outputs", ())):
            if tensor is not None:
                watch.mark(tensor, Category.UNSHARDED_PARAMETERS)

    with patched(group_module, "foreach_all_gather", all_gather), \
            patched(group_module, "foreach_reduce", reduce_scatter), \
            patched(param_module.FSDPParam, "init_unsharded_param", unsharded), \
            (patched(param_module.FSDPParam, "all_gather_inputs", property(all_gather_inputs)) if staged
             else contextlib.nullcontext()):
        yield


# The streams of FSDP2's allocations under CUDA semantics (``Record.stream``; 0 is the default stream).
COPY_IN_STREAM, REDUCE_SCATTER_STREAM = 1, 2


@contextlib.contextmanager
def _reduce_streams(comm, ledger):
    """``foreach_reduce`` allocates the reduce-scatter input on the current stream, then enters the
    reduce-scatter stream for the output and all after it (the post-reduce cast, HSDP's all-reduce
    stream taken as the same)."""
    from memfit.scoped import patched

    allocate = comm.allocate
    calls = 0
    scope = contextlib.ExitStack()

    def counted(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 2:  # the output: from here on, the reduce-scatter stream
            scope.enter_context(ledger.on_stream(REDUCE_SCATTER_STREAM))
        return allocate(*args, **kwargs)

    with scope, patched(comm, "allocate", counted):
        yield


def host_records(ledger) -> set[int]:
    """Records an offloaded FSDP2 step keeps in host memory: the shards, their gradients, the optimizer
    state, and what the optimizer step allocates (it runs on the host). Everything else is the GPU's."""
    from memfit.categories import Category

    host = {Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATE}
    return {i for i, r in enumerate(ledger.records) if r.category in host or r.phase == "optimizer"}


def _replicate(build, place) -> None:
    from torch.nn.parallel import DistributedDataParallel

    # DDP replicates over the whole world (the default group), across nodes too.
    if not place.fake:
        # torch's defaults, as a plain script has them (the start-up broadcast is construction)
        build.model = DistributedDataParallel(build.model, init_sync=place.init_sync,
                                              broadcast_buffers=place.broadcast_buffers)
        return
    # On fake tensors DDP's start-up broadcast and per-forward buffer broadcast read data pointers:
    # both are off here (a coalesced copy of the buffers per forward, small beside a step, goes unseen).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # broadcast_buffers' rename
        build.model = DistributedDataParallel(build.model, broadcast_buffers=False, init_sync=False)
    on_fake_group(build.model, build.watch)


def on_fake_group(ddp, watch) -> None:
    """``ddp`` (a DDP made with ``init_sync=False`` and ``broadcast_buffers=False`` on fake tensors and the fake
    process group) made to run there: the fake group's all-reduce completes with no value, so a comm hook gives
    DDP's reducer its bucket back (marked ``communication`` in ``watch``), and the reducer's bucket rebuild, which
    reads a data pointer, is left out (``_NoRebuild``). A user's script's DDP goes through it too
    (``script/ranks.py``)."""
    ddp.register_comm_hook(watch, _bucket_back)
    ddp.reducer = _NoRebuild(ddp.reducer)


class _NoRebuild:
    """DDP's reducer, less the bucket rebuild at the second step's forward: the rebuild reads a
    gradient's data pointer, which a fake tensor has not. It frees the old buckets before making
    the new ones (``Reducer::initialize_buckets``), the same bytes in the order gradients became
    ready, so the memory of the step does not change."""

    def __init__(self, reducer):
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._reducer, name)


def _bucket_back(watch, bucket):
    """A DDP comm hook for the fake process group: the bucket reduced in place, as the built-in
    all-reduce hook leaves it (no memory of its own); labels the bucket."""
    import torch

    from memfit.categories import Category

    watch.mark(bucket.buffer(), Category.COMMUNICATION)
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _sync_last(model, last: bool) -> None:
    model.set_requires_gradient_sync(last)


def _ddp_sync_last(model, last: bool) -> None:
    model.require_backward_grad_sync = last


TECHNIQUE = Technique(
    name="parallel",
    fields=(Field("parallel", "none", "none | ddp | fsdp: data parallelism over --gpus (FSDP2 shards parameters, "
                  "gradients and optimizer state 1/N per rank)", slot=120, choices=PARALLEL),
            Field("reshard_after_forward", "true", "fsdp: true frees gathered parameters after forward (ZeRO-3), "
                  "false keeps them to backward (ZeRO-2: more memory, one all-gather less), N: regather in "
                  "groups of N", slot=121, check=_check_reshard),
            Field("mixed_precision", "none", "fsdp: FSDP2 MixedPrecisionPolicy, compute[:reduce] dtype (bf16, "
                  "bf16:fp32): gathered parameters and gradients in it, shards stay fp32", slot=122,
                  check=_check_mixed),
            Field("offload", "none", "fsdp: FSDP2 CPUOffloadPolicy: shards, their gradients and the optimizer step on the "
                  "host (cpu: pinned, FSDP2's default; cpu-unpinned); host RAM and the host link pay", slot=124,
                  choices=OFFLOAD),
            Field("shard_over", "node", "fsdp over several nodes: node shards within a node and replicates "
                  "between (HSDP, the default); world shards over every rank (less memory, all-gathers cross the "
                  "network)", slot=125, choices=("node", "world")),
            Field("sync_grads", "last", "with accumulation: reduce gradients on the last micro-batch only "
                  "(no_sync; fsdp keeps unsharded gradients meanwhile) or every one", slot=123,
                  choices=("last", "every")),
            Field("tp", 1, "tensor parallel degree: the model's own plan (colwise / rowwise linears) over N GPUs "
                  "of a node, each holding 1/N of those weights and their heads' activations; the other GPUs are "
                  "data parallel (parallel=fsdp shards over them)", slot=127, kind="int", check=check_tp),
            Field("sequence_parallel", False, "with tp: the residual stream between the blocks sharded over the "
                  "sequence (torch's SequenceParallel norms, as torchtitan applies it): its activations 1/tp per "
                  "rank; each block all-gathers its input and reduce-scatters its output", slot=128, kind="bool"),
            Field("pp", 1, "pipeline parallel degree: the model's blocks cut into N stages, one per GPU "
                  "(torch.distributed.pipelining); each rank holds its stage and the activations of the "
                  "micro-batches in flight (grad_accum_steps micro-batches a step)", slot=130, kind="int",
                  check=check_pp),
            Field("pp_schedule", "1f1b", "with pp: gpipe (every forward, then every backward: all micro-batches' "
                  "activations live), 1f1b (backward starts once the pipeline is full: stage i of N holds N - i) "
                  "or interleaved-1f1b (two stages a rank, looped: a smaller bubble)",
                  slot=131, choices=tuple(SCHEDULES)),
            Field("loss_parallel", False, "with tp: the head's logits stay sharded over the vocabulary and the "
                  "cross-entropy runs on the shards (torch's loss_parallel): no rank holds the whole logits",
                  slot=129, kind="bool"),
            Field("ep", 1, "expert parallel degree: each MoE layer's experts split over N ranks of an FSDP2 group "
                  "(transformers' expert plan), tokens sent to their experts' rank by all-to-all; the dense blocks "
                  "stay FSDP2-sharded over the whole group (parallel=fsdp)", slot=132, kind="int", check=check_ep),
            Field("cp", 1, "context parallel degree: each row's sequence split over N ranks of an FSDP2 group "
                  "(torch's context_parallel, load-balanced), attention run as a ring over them; they read the same "
                  "rows (parallel=fsdp, attention=sdpa)", slot=133, kind="int", check=check_cp),
            Field("cp_rotate", "allgather", "with cp: how each layer's keys and values reach the other ranks: "
                  "allgather (once, whole: torchtitan's default) or alltoall (passed round the ring, one chunk at a "
                  "time)", slot=134, choices=ROTATE),
            Field("construction", "meta", "fsdp: how the model was built before sharding: meta (torchtitan: never "
                  "whole), host (whole in each rank's host RAM, then sharded) or device (whole on the GPU, then "
                  "sharded: its peak counts)", slot=126, choices=CONSTRUCTION)),
    order=20, apply=_apply, conflicts=_conflicts, trace="none")
