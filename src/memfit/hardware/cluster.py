"""The cluster a step runs on: ``World`` (GPUs per node x nodes), the rank, and its device mesh.

A sharded or replicated step (``techniques/parallel.py``) needs a process group and a device mesh.
The estimate runs one rank's step on fake tensors under PyTorch's *fake* process group (backend
``"fake"``, ``FakeStore``: every collective returns at once and moves nothing), so the step that is
estimated is FSDP2's or DDP's own, run by PyTorch itself; real runs (``torchrun``) use the process
group that is initialised. The mesh is made here, outside ``FakeTensorMode``: a mesh made inside it
would hold fake tensors. Across nodes the mesh is 2-D (replicate between nodes, shard within: HSDP).

Why by hand: torch's ``FSDPMemTracker`` (private) makes the same fake group for its own tracker, but
offers no context that a user's step, memfit's ledger and an existing process group can share.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

from memfit.errors import MemfitError, shown

__all__ = ["World", "Placement", "placement", "fake_world", "real_world", "world_of", "MAX_GPUS"]

# Bounds: past these nobody trains (the largest published runs use ~16k GPUs).
MAX_GPUS = 1 << 17


@dataclass(frozen=True)
class World:
    """``gpus`` per node x ``nodes``: the ranks of one data-parallel run."""

    gpus: int = 1
    nodes: int = 1

    @property
    def size(self) -> int:
        return self.gpus * self.nodes

    def describe(self) -> str:
        return f"{self.size} GPU(s)" if self.nodes == 1 else f"{self.nodes} nodes x {self.gpus} GPUs = {self.size}"


@dataclass(frozen=True)
class Placement:
    """Where this rank's step runs: the world, this rank and the mesh made for it."""

    world: World
    rank: int
    mesh: object  # a torch DeviceMesh: 1-D (size,) or 2-D (nodes, gpus) named ("replicate", "shard")
    flat: object  # the 1-D mesh over every rank (``mesh`` itself on one node)
    fake: bool  # under the fake process group (an estimate), or a real one
    notes: dict = field(default_factory=dict)  # what the step's techniques found ("uneven": a parameter's name)
    init_sync: bool = True  # DDP broadcasts rank 0's parameters at construction (real runs)
    broadcast_buffers: bool = True  # DDP broadcasts rank 0's buffers at each forward (torch's default)


_CURRENT: contextvars.ContextVar[Placement | None] = contextvars.ContextVar("memfit_placement", default=None)


def world_of(gpus=None, nodes=None) -> World | None:
    """A checked ``World`` from ``gpus`` (per node) and ``nodes``; None when neither is given."""
    if gpus is None and nodes is None:
        return None
    if gpus is None:
        raise MemfitError(f"nodes={shown(nodes)} needs gpus= (GPUs per node; on the command line --gpus N --nodes M)")
    for name, value in (("gpus", gpus), ("nodes", 1 if nodes is None else nodes)):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_GPUS:
            raise MemfitError(f"{name} must be an integer from 1 to {MAX_GPUS}, got {shown(value)}")
    world = World(gpus, nodes or 1)
    if world.size > MAX_GPUS:
        raise MemfitError(f"{world.describe()} is more than {MAX_GPUS} GPUs: use fewer nodes or GPUs")
    return world


def placement() -> Placement:
    """This rank's placement: the one set by ``fake_world`` / ``real_world``, else the initialised
    process group's (``torchrun``), else an error naming the fix."""
    current = _CURRENT.get()
    if current is not None:
        return current
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return _placement(World(dist.get_world_size()), dist.get_rank(), fake=False)
    raise MemfitError("parallel=ddp/fsdp needs a process group: pass gpus= to estimate (--gpus N), or run the "
                      "step under torchrun")


def _device_type(fake: bool) -> str:
    """The mesh's device: the fake group and gloo move CPU tensors, NCCL CUDA ones."""
    import torch.distributed as dist

    return "cuda" if not fake and dist.get_backend() == "nccl" else "cpu"


def _mesh(world: World, device: str = "cpu"):
    from torch.distributed.device_mesh import init_device_mesh

    if world.nodes == 1:
        return init_device_mesh(device, (world.size,), mesh_dim_names=("shard",))
    return init_device_mesh(device, (world.nodes, world.gpus), mesh_dim_names=("replicate", "shard"))


def _placement(world: World, rank: int, fake: bool, init_sync: bool = True, broadcast_buffers: bool = True) -> Placement:
    from torch.distributed.device_mesh import init_device_mesh

    device = _device_type(fake)
    mesh = _mesh(world, device)
    flat = mesh if world.nodes == 1 else init_device_mesh(device, (world.size,), mesh_dim_names=("world",))
    return Placement(world, rank, mesh, flat, fake, init_sync=init_sync, broadcast_buffers=broadcast_buffers)


@contextlib.contextmanager
def fake_world(world: World, rank: int = 0):
    """Rank ``rank`` of ``world`` under PyTorch's fake process group, for the ``with`` block."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if not 0 <= rank < world.size:
        raise MemfitError(f"rank {rank} is not in a world of {world.size}")
    if dist.is_initialized():
        raise MemfitError("a process group is initialised already: estimate a world size before "
                          "init_process_group, or in a process of its own (not under torchrun)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world.size)
    token = None
    try:
        token = _CURRENT.set(_placement(world, rank, fake=True))
        yield _CURRENT.get()
    finally:
        if token is not None:
            _CURRENT.reset(token)
        dist.destroy_process_group()


@contextlib.contextmanager
def real_world(gpus_per_node: int | None = None, init_sync: bool = True, broadcast_buffers: bool = True):
    """The initialised (real) process group as a ``Placement``, for the ``with`` block: a run under
    ``torchrun``. ``gpus_per_node`` (default: the whole world on one node) makes the mesh 2-D.
    ``init_sync=False``: DDP skips its start-up broadcast (every rank built the same weights);
    ``broadcast_buffers=False``: and its per-forward buffer broadcast (no collective in forward)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise MemfitError("no process group is initialised: run under torchrun (init_process_group first)")
    size = dist.get_world_size()
    gpus = gpus_per_node or size
    if size % gpus:
        raise MemfitError(f"gpus_per_node={gpus} does not divide the world size {size}")
    token = _CURRENT.set(_placement(World(gpus, size // gpus), dist.get_rank(), fake=False, init_sync=init_sync,
                                    broadcast_buffers=broadcast_buffers))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)
