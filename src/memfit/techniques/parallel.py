"""Data parallelism: PyTorch's FSDP2 (``fully_shard``) or DDP over the ranks of a ``World``.

``parallel=fsdp`` shards every repeated block with ``fully_shard``, then the root, as torchtitan
and torchtune wrap; ``shard_modules`` names modules made units of their own besides (torchtune's
``custom_sharded_layers``: the embedding and head then gathered only while they run, not kept with the
root). Each rank keeps 1/N of the parameters, their gradients and the optimizer state; a unit's full
parameters exist only between its all-gather and its reshard. Memory per rank: the
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
and the caching allocator keeps a pool per stream (``fsdp_step.py``).

``offload`` is FSDP2's ``CPUOffloadPolicy``: the shards, their gradients and the optimizer state live
in host memory (pinned by default) and the optimizer steps there; each unit's shard is copied to the
GPU for its all-gather and each sharded gradient back after its reduce-scatter. The GPU then holds
the gathered units, activations and buffers; the host the rest (``fsdp_step.host_records``).

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

This module declares the technique (its fields, their checks and conflicts) and applies it; FSDP2's
sharding is ``fsdp.py``, its tensors during the step ``fsdp_step.py``, DDP ``ddp.py``.

``compile=layers`` combines (each block compiled, then wrapped: FSDP2's hooks run around the compiled
forward, as torchtune and torchtitan compile per layer): exact against torchrun on 2 ranks (``tests/test_distributed.py``,
``bench/distributed/distributed.py``). Does not combine with (yet, each one error): chunked_loss (its head runs
outside the root's forward, on resharded weights), compile=true (one graph over FSDP2's hooks: not checked), 8/4-bit
optimizers (bitsandbytes does not take DTensors), offload_optimizer and optimizer_in_backward; qlora only as torchtune
shards it, in torchao's NF4 (``quant_impl=torchao``: ``NF4Tensor``'s own FSDP2 hooks gather its packed codes and
scalers; bitsandbytes' ``Params4bit`` does not survive FSDP2), and not under DDP.
"""

from __future__ import annotations

from memfit.techniques.spec import Field, Technique
from memfit.techniques.context_parallel import ROTATE, check_cp, context_parallel, cp_conflict
from memfit.techniques.ddp import replicate
from memfit.techniques.zero_config import STAGES
from memfit.techniques.expert_parallel import check_ep, ep_conflict, expert_parallel
from memfit.techniques.fsdp import mixed_dtypes, module_names, reshard_value, shard
from memfit.techniques.fsdp_step import fsdp_roles, host_records
from memfit.techniques.tensor_parallel import check_tp, tensor_parallel, tp_conflict
from memfit.techniques.pipeline_parallel import SCHEDULES, check_pp, pipeline, pipeline_conflict

__all__ = ["TECHNIQUE", "reshard_value", "mixed_dtypes", "PARALLEL", "OFFLOAD", "CONSTRUCTION", "host_records"]

PARALLEL = ("none", "ddp", "fsdp", "zero1", "zero2", "zero3")  # zero*: DeepSpeed ZeRO (deepspeed.py)
OFFLOAD = ("none", "cpu", "cpu-unpinned")
CONSTRUCTION = ("meta", "host", "device")
#: optimizers whose step runs only on a GPU (bitsandbytes, torchao kernels): not on an offloaded host
_DEVICE_ONLY = ("8bit", "4bit", "paged", "fp8")


def _check_reshard(value) -> None:
    reshard_value(value)


def _check_mixed(value) -> None:
    mixed_dtypes(value)


def _check_modules(value) -> None:
    module_names(value)


_INCOMPATIBLE = (("chunked_loss", lambda r: bool(r.chunked_loss)),
                 ("compile", lambda r: r.compile is True),  # compile=layers combines
                 ("offload_optimizer", lambda r: bool(r.offload_optimizer)),
                 ("optimizer_in_backward", lambda r: bool(r.optimizer_in_backward)),
                 ("lora", lambda r: str(r.lora).startswith("qlora") and r.parallel != "fsdp"),
                 ("optimizer", lambda r: any(k in str(r.optimizer) for k in ("8bit", "4bit", "paged"))))


def _conflicts(recipe):
    if recipe.parallel in STAGES:  # DeepSpeed's: deepspeed.py says what it cannot have
        return
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
    if recipe.shard_modules and recipe.pp > 1:
        yield (f"shard_modules={recipe.shard_modules} and pp={recipe.pp} conflict: each rank holds a pipeline stage, "
               "not the model's modules by their names; drop shard_modules")
        return
    if recipe.parallel != "fsdp" and recipe.shard_modules:
        yield (f"shard_modules={recipe.shard_modules} and parallel={recipe.parallel} conflict: shard_modules are "
               "FSDP2's units; set parallel=fsdp")
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
    if recipe.parallel == "fsdp" and str(recipe.lora).startswith("qlora") and recipe.quant_impl != "torchao":
        yield (f"parallel=fsdp and lora={recipe.lora} with quant_impl={recipe.quant_impl} conflict: bitsandbytes' 4-bit "
               "weights do not shard under FSDP2; torchao's NF4 does (torchtune's QLoRA): set quant_impl=torchao")
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
    if (recipe.parallel == "none" and recipe.tp == 1 and recipe.pp == 1) or recipe.parallel in STAGES:
        return  # DeepSpeed's engine is made with the optimizer (deepspeed.py)
    from memfit.hardware.cluster import placement

    place = placement()
    if recipe.pp > 1 or recipe.tp > 1 or recipe.ep > 1 or recipe.cp > 1:
        place = _mesh_parallel(build, place)  # this rank's data-parallel ranks
        if recipe.parallel == "none":
            build.watch.settle()
            return
    if recipe.parallel == "fsdp":
        shard(build, place)
    else:
        replicate(build, place)
    if recipe.parallel == "fsdp":
        build.step_contexts.append(lambda: fsdp_roles(build.watch))
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


def _sync_last(model, last: bool) -> None:
    model.set_requires_gradient_sync(last)


def _ddp_sync_last(model, last: bool) -> None:
    model.require_backward_grad_sync = last


TECHNIQUE = Technique(
    name="parallel",
    fields=(Field("parallel", "none", "none | ddp | fsdp | zero1-3: data parallelism over --gpus (FSDP2 shards "
                  "parameters, gradients and optimizer state 1/N per rank; zeroN: DeepSpeed's ZeRO stage N)", slot=120,
                  choices=PARALLEL),
            Field("reshard_after_forward", "true", "fsdp: true frees gathered parameters after forward (ZeRO-3), "
                  "false keeps them to backward (ZeRO-2: more memory, one all-gather less), N: regather in "
                  "groups of N", slot=121, check=_check_reshard),
            Field("mixed_precision", "none", "fsdp: FSDP2 MixedPrecisionPolicy, compute[:reduce] dtype (bf16, "
                  "bf16:fp32): gathered parameters and gradients in it, shards stay fp32", slot=122,
                  check=_check_mixed),
            Field("offload", "none", "fsdp: FSDP2 CPUOffloadPolicy: shards, their gradients and the optimizer step on the "
                  "host (cpu: pinned, FSDP2's default; cpu-unpinned); host RAM and the host link pay", slot=124,
                  choices=OFFLOAD),
            Field("shard_modules", "", "fsdp: modules wrapped as FSDP2 units of their own besides the blocks, by name "
                  "(torchtune's custom_sharded_layers: tok_embeddings,output): gathered only while they run, not "
                  "kept with the root", slot=126, check=_check_modules),
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
