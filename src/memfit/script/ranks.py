"""A script run as one rank of ``torchrun --nproc-per-node GPUS --nnodes NODES`` would run it, on PyTorch's fake
process group.

What torchrun gives a rank is set for the run (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and the script's own ``init_process_group`` (nccl, gloo or
the default) starts PyTorch's ``"fake"`` backend instead (``FakeStore``: every collective returns at once
and moves nothing; ``hardware/cluster.py`` runs memfit's own FSDP2 and DDP steps on it the same way). DDP,
FSDP2 and device meshes then run in the script's own code; a ``cuda`` mesh is the card's (its tensors are
fake CPU tensors, so the mesh is made on ``cpu``). The estimate is of one rank (``rank``, default 0).

Left out: ranks whose work differs in a way their rank alone decides beyond data (pipeline stages: estimate
each stage's rank with ``rank=``); what NCCL holds outside the allocator is counted as for memfit's own
runs (``hardware/outside.py``: one communicator per process group).
"""

from __future__ import annotations

import contextlib

from memfit.scoped import patched

__all__ = ["as_rank", "Groups"]


class Groups:
    """The process groups the script made: ``count`` (the default one and each ``new_group``; on a GPU each
    with peers is an NCCL communicator, ``hardware/outside.py``) and ``world_size``."""

    def __init__(self):
        self.count, self.world_size = 0, 1


@contextlib.contextmanager
def _ddp_on_fake_group(watch):
    """The script's ``DistributedDataParallel`` as memfit's own runs it on the fake group (``techniques/parallel.py``):
    no start-up sync or per-forward buffer broadcast (both read data), no ``device_ids`` (the module's tensors are
    fake CPU tensors; its inputs still go to the card, where its parameters say they are)."""
    import inspect
    import warnings

    from torch.nn.parallel import DistributedDataParallel

    from memfit.techniques.ddp import on_fake_group

    init = DistributedDataParallel.__init__
    signature = inspect.signature(init)

    def on_fake(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.arguments.update(device_ids=None, output_device=None, init_sync=False, broadcast_buffers=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            init(*bound.args, **bound.kwargs)
        on_fake_group(self, watch())

    with patched(DistributedDataParallel, "__init__", on_fake):
        yield


@contextlib.contextmanager
def as_rank(gpus: int, nodes: int = 1, rank: int = 0, *, watch=None):
    """While active, the process is rank ``rank`` of ``gpus`` x ``nodes`` ranks, as torchrun starts it; yields
    the ``Groups`` the script makes. ``watch()``: the ledger, once it exists (DDP's buckets are marked in it)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    from memfit.hardware.cluster import forget_meshes

    world = gpus * nodes
    init, new_group = dist.init_process_group, dist.new_group
    groups = Groups()

    def fake_init(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None, **kwargs):
        if dist.is_initialized():
            raise RuntimeError("trying to initialize the default process group twice!")
        size = world if world_size in (-1, None) else world_size
        me = _rank if rank in (-1, None) else rank
        init("fake", store=FakeStore(), rank=me, world_size=size)
        groups.count, groups.world_size = 1, size

    def counted_group(*args, **kwargs):
        made = new_group(*args, **kwargs)
        groups.count += 1
        return made

    _rank = rank
    values = {"RANK": rank, "LOCAL_RANK": rank % gpus, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": gpus,
              "GROUP_RANK": rank // gpus, "NODE_RANK": rank // gpus, "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "memfit"}
    with contextlib.ExitStack() as scope:
        for name, value in values.items():
            scope.enter_context(_set(name, str(value)))
        scope.enter_context(patched(dist, "init_process_group", fake_init))
        scope.enter_context(patched(dist, "new_group", counted_group))
        scope.enter_context(_cpu_meshes())
        scope.enter_context(_ddp_on_fake_group(watch))
        try:
            yield groups
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            forget_meshes()


@contextlib.contextmanager
def _set(name: str, value: str):
    """``os.environ[name] = value`` while active (over what the user set: this process is the rank), restored."""
    import os

    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


@contextlib.contextmanager
def _cpu_meshes():
    """A ``cuda`` device mesh made on ``cpu``: the card's tensors are fake CPU tensors (``device.py``)."""
    import torch.distributed.device_mesh as meshes

    make = meshes.init_device_mesh

    def on_cpu(device_type, *args, **kwargs):
        return make("cpu" if str(device_type).startswith("cuda") else device_type, *args, **kwargs)

    with patched(meshes, "init_device_mesh", on_cpu):
        import torch.distributed as dist

        owner = getattr(dist, "device_mesh", None)
        with (patched(owner, "init_device_mesh", on_cpu) if owner is not None and owner is not meshes
              else contextlib.nullcontext()):
            yield
