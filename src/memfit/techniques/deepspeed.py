"""DeepSpeed ZeRO 1/2/3 (``parallel=zero1|zero2|zero3``): DeepSpeed's own engine, run on memfit's fake tensors.

Why the engine itself rather than a replay of its allocations beside memfit's traced step: ZeRO allocates some
forty kinds of tensors of its own (flat 16-bit buffers and their build-time copy, fp32 master partitions, gradient
buckets and the partition they fill, a straddling parameter's whole gradient, fp64 norm copies, stage 3's gathers,
prefetch queue, reuse distance and persistence, the lazily made Adam state), several of which changed between minor
versions. Run on fake tensors under the ledger, the pinned version's code makes exactly its own (research/deepspeed/:
13 configurations x 2 ranks within 112 bytes of the real engine's allocator events on CPU). The cost is five things
fake tensors cannot do, done here for the engine and only while it runs (``_on_fake``): a fake tensor's
``data_ptr`` (stage 1/2's alignment assert), ``module.to(device)`` (a fake parameter cannot be swapped for itself),
the CPU backend's JIT-built shared-memory op (inference only), stage 3's cross-rank list checks (they read rank 0's
list back through a collective that a fake process group does not move) and DeepSpeed's accelerator, set to its CPU
one (the fake tensors' device).

``zero`` takes DeepSpeed's own ``zero_optimization`` keys as ``key=value,...`` (``ZeroConfig``, ``zero_config.py``,
which reads and writes DeepSpeed's configs without DeepSpeed installed): what a ``ds_config.json`` says is what memfit
runs. The optimizer is memfit's (the recipe's, a client optimizer as the
Hugging Face Trainer passes its own); DeepSpeed's ``bf16`` / ``fp16`` sections follow ``precision`` (``bf16``: the
model cast to bf16 by the engine, fp32 master partitions).

QLoRA (bitsandbytes' 4-bit base, frozen) runs under every stage: under 1 and 2 the base stays whole on every rank and
the engine partitions the adapters' gradients and states; under 3 the codes are packed as bf16 (transformers'
``bnb_4bit_quant_storage``, ``lora.py``) and partitioned and gathered like any weight (``bench/distributed/deepspeed.py``'s
``z2-qlora`` and ``z3-qlora`` cases).

Left out (each refused in one line): QLoRA in torchao's NF4, NVMe offload, ZeRO++ (``zero_quantized_*``, ``zero_hpz_partition_size``), MiCS,
ZenFlow, ``super_offload``, an offload ``ratio`` below 1; tensor/pipeline/expert/context parallelism with ZeRO;
CUDA streams (``overlap_comm`` on a GPU frees a reduced bucket when its side stream catches up: the sizes here, the
timing not); fp16 truths (the CPU runs bf16 and fp32 only).
"""

from __future__ import annotations

import contextlib
import os

from memfit.errors import MemfitError
from memfit.techniques.deepspeed_offload import held_tensors, hosted_step, mark as offload_mark, pinning
from memfit.techniques.spec import Field, Technique
from memfit.techniques.zero_config import VERSION, ZeroConfig, check_zero, ds_config, zero_conflict, zero_stage

__all__ = ["TECHNIQUE", "zero_conflict", "torch_as_found"]

def _deepspeed():
    try:
        with _quiet_import():
            import deepspeed
    except ImportError:
        raise MemfitError(f"parallel=zero1/2/3 runs DeepSpeed's engine: pip install 'memfit[deepspeed]' (deepspeed=="
                          f"{VERSION})") from None
    if deepspeed.__version__ != VERSION:
        raise MemfitError(f"deepspeed {deepspeed.__version__} is installed; memfit models {VERSION}'s allocations: "
                          f"pip install deepspeed=={VERSION}")
    return deepspeed


@contextlib.contextmanager
def _quiet_import():
    """DeepSpeed logs its accelerator choice and op-builder warnings when imported; the CPU accelerator is set, and
    nothing is built (DS_BUILD_OPS=0)."""
    import logging

    saved = {key: os.environ.get(key) for key in ("DS_ACCELERATOR", "DS_BUILD_OPS")}
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("DS_BUILD_OPS", "0")
    level = logging.getLogger("DeepSpeed").level
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    try:
        yield
    finally:
        _restore(saved)
        logging.getLogger("DeepSpeed").setLevel(level)


@contextlib.contextmanager
def _on_fake(place, watch=None):
    """What the engine needs to run on fake tensors over a fake world (the module docstring's five), for the block;
    with ``watch`` (a trace for a card), what DeepSpeed pins is marked its pinned host memory (``pinning``)."""
    import logging

    import torch
    import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator

    from memfit.scoped import patched

    real_data_ptr = torch.Tensor.data_ptr

    def data_ptr(tensor):
        if isinstance(tensor, torch._subclasses.FakeTensor):
            return 0  # aligned: the assert it feeds checks a partition's start, which the fake buffer does not have
        return real_data_ptr(tensor)

    # what torchrun would have set: DeepSpeed reads its rank and local rank from the environment
    env = {"RANK": str(place.rank), "LOCAL_RANK": str(place.rank % place.world.gpus),
           "WORLD_SIZE": str(place.world.size), "LOCAL_SIZE": str(place.world.gpus)}
    saved = {key: os.environ.get(key) for key in env}
    logger = logging.getLogger("DeepSpeed")
    with contextlib.ExitStack() as scope:
        scope.enter_context(_on_cpu())
        if watch is not None and hasattr(watch, "host_tensor"):
            from deepspeed.accelerator import get_accelerator

            scope.enter_context(patched(get_accelerator(), "pin_memory", pinning(watch)))
        scope.enter_context(patched(torch.Tensor, "data_ptr", data_ptr))
        for name in ("assert_ints_same_as_other_ranks", "assert_lst_len_same_as_other_ranks"):
            if hasattr(coordinator, name):
                scope.enter_context(patched(coordinator, name, lambda *args, **kwargs: None))
        scope.callback(logger.setLevel, logger.level)
        scope.callback(_restore, saved)
        os.environ.update(env)
        logger.setLevel(logging.ERROR)  # its start-up lines, once per estimate
        yield


def _restore(saved: dict) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


class _Engine:
    """DeepSpeed's engine as the step sees it: called as the model, ``backward(loss)`` as DeepSpeed wants it (its
    ``step`` after every micro-batch but the last: it counts them to find the accumulation boundary)."""

    def __init__(self, engine, scope, watch=None, after=None):
        self.engine, self.scope, self.watch, self.after = engine, scope, watch, after  # after: ZeRO-Offload's marks

    def __call__(self, *args, **kwargs):
        with self.scope():
            return self.engine(*args, **kwargs)

    def backward(self, loss) -> None:
        with self.scope():
            self.engine.backward(loss)
            _mark_buffers(self.engine.optimizer, self.watch)
            if self.after is not None:
                self.after()
            if not self.engine.is_gradient_accumulation_boundary():
                self.engine.step()


def _mark_buffers(optimizer, watch) -> None:
    """The roles of what DeepSpeed's optimizer holds after a backward, by its own attribute names (0.19.8): its
    reduction buckets (``ipg_buckets``) are communication buffers, the gradient partitions they fill (stage 2's
    ``grads_in_partition``, stage 3's ``grad_partitions_flat_buffer``, ``averaged_gradients``) gradients. Otherwise
    the ledger sees them as temporaries (made inside backward, held by no ``.grad``)."""
    if watch is None:
        return
    from memfit.categories import Category

    for bucket in (getattr(optimizer, "ipg_buckets", None) or {}).values():
        for tensor in held_tensors(getattr(bucket, "buffer", None)):
            watch.mark(tensor, Category.COMMUNICATION)
    for name in ("grads_in_partition", "grad_partitions_flat_buffer", "averaged_gradients"):
        for tensor in held_tensors(getattr(optimizer, name, None)):
            watch.mark(tensor, Category.GRADIENTS)


@contextlib.contextmanager
def _marked(watch, stage: int):
    """While the engine runs: stage 1/2's reduction buckets, made at each backward's start (``setup_buckets``), marked
    as communication buffers; stage 3's gathered parameters (the coordinator's fetch of a module's partitions,
    prefetched ones as their module is fetched) as unsharded parameters, as FSDP2's are."""
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator, stage_1_and_2

    from memfit.categories import Category
    from memfit.scoped import patched

    if stage < 3:
        cls = stage_1_and_2.DeepSpeedZeroOptimizer
        setup = cls.setup_buckets

        def setup_marked(self):
            setup(self)
            for bucket in self.ipg_buckets.values():
                for tensor in bucket.buffer:
                    watch.mark(tensor, Category.COMMUNICATION)

        with patched(cls, "setup_buckets", setup_marked):
            yield
        return
    cls = coordinator.PartitionedParameterCoordinator
    fetch = cls.fetch_sub_module

    def fetch_marked(self, current_submodule, forward):
        fetch(self, current_submodule, forward)
        for param in current_submodule.parameters(recurse=False):
            if param.numel():
                watch.mark(param, Category.UNSHARDED_PARAMETERS)

    with patched(cls, "fetch_sub_module", fetch_marked):
        yield


class _EngineOptimizer:
    """The optimizer the step sees: ``step`` is the engine's (the optimizer steps at the accumulation boundary),
    ``zero_grad`` the engine's own (done in its step), ``state`` the client optimizer's (on the fp32 partitions)."""

    def __init__(self, engine, base, scope, after=None):
        self.engine, self.base, self.scope, self.after = engine, base, scope, after

    @property
    def state(self):
        return self.base.state

    @property
    def param_groups(self):
        return self.base.param_groups

    def step(self, closure=None):
        with self.scope():
            self.engine.step()
        if self.after is not None:
            self.after()

    def zero_grad(self, set_to_none: bool = True):
        return None


def zero_engine(build, place) -> None:
    """``build``'s model handed to DeepSpeed's engine with the recipe's optimizer: the engine is made when the
    optimizer is (after every other technique changed the model), and owns forward, backward and the step."""
    from memfit.categories import Category
    from memfit.techniques.optimizer import make_optimizer

    deepspeed = _deepspeed()
    recipe = build.recipe
    config = ds_config(recipe, place.world.size, recipe.micro_batch_size or 1, hidden=_hidden(build.model))
    make_base = build.make_optimizer or (lambda params: make_optimizer(build.optimizer_spec, params))
    model = build.model
    zero = ZeroConfig.parse(recipe.zero)
    offload = place.fake and (zero.get("offload_optimizer") != "none" or zero.get("offload_param") != "none")

    def scope():
        if place.fake:
            return _on_fake(place, build.watch if offload else None)
        # a real run: the accelerator of its process group (the model may be built on the host, the engine moves it)
        return _on_cuda() if _nccl() else _on_cpu()

    def make(params):
        base = make_base(params)
        if offload:  # ZeRO-Offload on a trace for a card: the client optimizer steps on the host partitions
            hosted_step(base, build.watch)
        import deepspeed.comm.comm as ds_comm
        from deepspeed.utils import groups

        # DeepSpeed's backend and groups of an earlier world (an estimate's, a truth's case before) hold that world's
        # process groups: released, as its own destroy_process_group does, and made again
        ds_comm.cdb = None
        groups._release_process_group_references()
        with scope(), patched_to(model) if place.fake else contextlib.nullcontext(), \
                contextlib.nullcontext() if place.init_sync else _no_broadcast():
            engine, _, _, _ = deepspeed.initialize(model=model, optimizer=base, config=config)
        for param in model.parameters():  # views of the engine's flat 16-bit buffer (stage 1/2) or partitions
            build.watch.mark(param, Category.PARAMETERS)
            if hasattr(param, "ds_tensor"):
                build.watch.mark(param.ds_tensor, Category.PARAMETERS)
        optimizer = engine.optimizer
        for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition"):
            for tensor in getattr(optimizer, name, None) or ():
                if tensor is not None:
                    build.watch.mark(tensor, Category.OPTIMIZER_STATE)  # the fp32 master weights
        after = (lambda: offload_mark(engine.optimizer, model, build.watch, zero)) if offload else None
        if after is not None:
            after()
        build.watch.settle()  # the engine's construction is before the step
        if zero_stage(recipe) < 3 and place.world.size > 1:
            # stage 1/2 cut one flat buffer into equal partitions: a parameter across a boundary counts in both ranks'
            # gradient partitions and the last holds the padding (the estimate traces the last rank too)
            place.notes.setdefault("uneven", "DeepSpeed's flat partitions")
        def marked():  # the engine's forward and backward, its buckets and gathers marked as they are made
            stack = contextlib.ExitStack()
            stack.enter_context(scope())
            stack.enter_context(_marked(build.watch, zero_stage(recipe)))
            return stack

        build.engine = _Engine(engine, marked, build.watch, after)
        return _EngineOptimizer(engine, base, scope, after)

    build.make_optimizer = make


def _hidden(model) -> int | None:
    """The hidden size the Trainer reads for ``auto`` buckets: ``hidden_size``, else the largest of ``hidden_sizes``,
    else the text model's."""
    config = getattr(model, "config", None)
    for source in (config, getattr(config, "text_config", None)):
        if getattr(source, "hidden_size", None):
            return source.hidden_size
        if getattr(source, "hidden_sizes", None):
            return max(source.hidden_sizes)
    return None


@contextlib.contextmanager
def torch_as_found():
    """torch's namespaces as they were before the block, whatever DeepSpeed's engine changed in them for the rest of
    its process (stage 3 puts its memory-efficient ``torch.nn.functional.linear`` in place and wraps
    ``torch.manual_seed``): a real run keeps them, and so does the estimate's step; the estimate's caller gets its
    torch back (``estimator/sharded.py`` around each rank's trace)."""
    import torch

    owners = (torch, torch.nn.functional, torch.Tensor, torch.nn.Module, torch.autograd.Function)
    saved = [(owner, dict(vars(owner))) for owner in owners]
    try:
        yield
    finally:
        for owner, before in saved:  # (names new since are left: torch binds submodules as they are imported)
            now = vars(owner)
            for name, value in before.items():
                if now.get(name, _MISSING) is not value:
                    setattr(owner, name, value)


_MISSING = object()


@contextlib.contextmanager
def _on_cpu():
    """A real run on the CPU (the truth, ``distributed/truth.py``): DeepSpeed's CPU accelerator, and no JIT-built
    shared-memory op (inference's all-reduce; g++ and minutes at start-up)."""
    from deepspeed.accelerator import real_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    from memfit.scoped import patched

    accelerator = real_accelerator.ds_accelerator
    real_accelerator.ds_accelerator = CPU_Accelerator()
    try:
        with patched(__import__("importlib").import_module("deepspeed.comm.torch"), "build_shm_op", lambda: None):
            yield
    finally:
        real_accelerator.ds_accelerator = accelerator


def _nccl() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"


@contextlib.contextmanager
def _on_cuda():
    """A real run on a GPU: DeepSpeed's CUDA accelerator for the block. Its import (``_quiet_import``) chose the CPU
    one, which an estimate's fake engine runs on; kept, the engine would leave the model on the host and broadcast it
    over NCCL ("No backend type associated with device type cpu", seen on an H200)."""
    from deepspeed.accelerator import real_accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    accelerator = real_accelerator.ds_accelerator
    real_accelerator.ds_accelerator = CUDA_Accelerator()
    try:
        yield
    finally:
        real_accelerator.ds_accelerator = accelerator


@contextlib.contextmanager
def _no_broadcast():
    """Start-up broadcasts skipped where every rank built the same weights (``Placement.init_sync`` false, the
    truth's): DeepSpeed broadcasts ``p.data.view(uint8)``, a temporary gloo's worker keeps a moment, and the
    parameter's storage was then freed on that thread, where the profiler records no free."""
    import torch.distributed as dist

    from memfit.scoped import patched

    class Done:  # an asynchronous call's handle
        def wait(self, *args, **kwargs):
            return True

    with patched(dist, "broadcast", lambda *args, **kwargs: Done() if kwargs.get("async_op") else None):
        yield


@contextlib.contextmanager
def patched_to(model):
    """``model.to`` as the identity while the engine starts: DeepSpeed moves the module to its device
    (engine.py, ``module.to(device)``), which a fake parameter cannot be swapped for; the model is on it already."""
    model.to = lambda *args, **kwargs: model
    try:
        yield
    finally:
        del model.to


def _conflicts(recipe):
    clash = zero_conflict(recipe)
    if clash:
        yield clash


def _normalize(values: dict) -> dict:
    """``zero`` in one spelling (DeepSpeed's defaults dropped, keys sorted, numbers whole): recipes that run the same
    engine are equal, and a file read back is the recipe written."""
    text = values.get("zero")
    if not isinstance(text, str) or not text:
        return values
    return {**values, "zero": ZeroConfig.parse(text).text}


def _apply(build) -> None:
    if not zero_stage(build.recipe):
        return
    from memfit.hardware.cluster import placement

    zero_engine(build, placement())


TECHNIQUE = Technique(
    name="deepspeed",
    fields=(Field("zero", "", "parallel=zero1-3: DeepSpeed's zero_optimization keys, key=value,... as its ds_config "
                  "names them (reduce_bucket_size=5e7, overlap_comm=true, offload_optimizer=cpu, "
                  "stage3_prefetch_bucket_size=...); empty: DeepSpeed's defaults (a 5e8-element gradient bucket)",
                  slot=135, check=check_zero),),
    # after the optimizer (60) and accumulation (63): the engine takes the recipe's optimizer and micro-batches
    order=65, apply=_apply, conflicts=_conflicts, trace="none", normalize=_normalize)
