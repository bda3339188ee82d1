"""FSDP2's tensors while a step runs: what each is (``fsdp_roles``), which stream allocates it, and which an
offloaded step keeps in host memory (``host_records``).

The roles are ``categories.py``'s: gathered parameters, unsharded gradients, communication buffers. Under CUDA
semantics each allocation carries its stream (``Record.stream``): FSDP2 gathers on its copy-in stream (implicit
prefetching) and reduce-scatters into buffers of its reduce-scatter stream, and the caching allocator keeps a pool
per stream. Left out: sharding the model (``fsdp.py``) and DDP's buckets (``ddp.py``).
"""

from __future__ import annotations

import contextlib

__all__ = ["fsdp_roles", "COPY_IN_STREAM", "REDUCE_SCATTER_STREAM", "host_records"]


# The streams of FSDP2's allocations under CUDA semantics (``Record.stream``; 0 is the default stream).
COPY_IN_STREAM, REDUCE_SCATTER_STREAM = 1, 2


@contextlib.contextmanager
def fsdp_roles(watch):
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
