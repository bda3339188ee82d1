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
import sys
import warnings
from dataclasses import dataclass, field

from memfit.errors import MemfitError, shown

__all__ = ["World", "Layout", "Placement", "placement", "fake_world", "real_world", "world_of", "MAX_GPUS",
           "forget_meshes"]

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
class Layout:
    """How the ranks of a ``World`` split, torchtitan's order (``ParallelDims``): ``pp`` outermost (stages
    across nodes, or within one), then the data-parallel ranks as ``replicate`` x ``shard`` (HSDP: FSDP2 shards
    over ``shard`` and replicates over ``replicate``), ``tp`` innermost (within a node, over NVLink). Rank
    ``r``'s coordinates are ``r``'s digits in that mixed radix. ``of`` checks a request and says the fix.

    ``ep`` (expert parallel) borrows from ``shard``, as torchtitan's EP borrows from its dp_shard: ``shard`` is
    ``efsdp`` x ``ep``, consecutive ranks of an FSDP2 group forming an EP group that splits each MoE layer's
    experts; FSDP2 shards the dense blocks over ``shard`` and each expert over ``efsdp``.

    ``cp`` (context parallel) borrows from ``shard`` the same way (torchtitan's dp_shard x cp, FSDP2 over both):
    ``shard`` is ``dp_shard`` x ``cp``, consecutive ranks of an FSDP2 group splitting each row's sequence; they
    read the same rows (``rows_split``: the ranks that read different ones)."""

    world: World
    pp: int = 1
    replicate: int = 1
    shard: int = 1
    tp: int = 1
    ep: int = 1
    cp: int = 1

    NAMES = ("pp", "replicate", "shard", "tp")

    @classmethod
    def of_recipe(cls, world: World, recipe):
        """The layout of ``world`` for a ``Recipe``'s degrees (read by name: this layer knows no recipe)."""
        return cls.of(world, pp=recipe.pp, tp=recipe.tp, ep=recipe.ep, cp=recipe.cp, parallel=recipe.parallel,
                      shard_over=recipe.shard_over)

    @classmethod
    def of(cls, world: World, *, pp: int = 1, tp: int = 1, ep: int = 1, cp: int = 1, parallel: str = "fsdp",
           shard_over: str = "node"):
        """The layout of ``world`` for these degrees; every mismatch is one error naming the fix."""
        if tp > 1 and world.gpus % tp:
            raise MemfitError(f"tp={tp} does not divide the {world.gpus} GPUs per node: tensor parallelism stays "
                              f"within a node; use a tp that divides --gpus")
        if world.size % (tp * pp):
            what = " x ".join(f"{n}={v}" for n, v in (("pp", pp), ("tp", tp)) if v > 1)
            raise MemfitError(f"{what} does not divide {world.describe()}: use degrees whose product divides the "
                              "GPUs")
        if pp > 1 and world.nodes > 1 and world.nodes % pp and pp % world.nodes:
            raise MemfitError(f"pp={pp} over {world.nodes} nodes: the stages split the nodes evenly (pp dividing "
                              "the nodes, or the nodes pp); pick such a pp or --nodes")
        dp = world.size // (tp * pp)
        if dp > 1 and parallel == "none":
            what = " x ".join(f"{n}={v}" for n, v in (("pp", pp), ("tp", tp)) if v > 1) or "one GPU a rank"
            raise MemfitError(f"{what} over {world.describe()} leaves {dp} data-parallel ranks: set parallel=fsdp "
                              f"(--parallel fsdp){' or ddp' if pp == 1 else ''}, or degrees that use every GPU")
        replicate = 1
        if shard_over == "node" and world.nodes > 1:
            # HSDP: one FSDP group a node (of a stage), replicated over the nodes that hold the same stage
            replicate = world.nodes // pp if world.nodes % pp == 0 else 1
        shard = dp // replicate
        if ep > 1 and parallel != "fsdp":
            raise MemfitError(f"ep={ep} needs parallel=fsdp: expert parallel splits the experts over ranks of an "
                              "FSDP2 group (--parallel fsdp)")
        if ep > 1 and shard % ep:
            raise MemfitError(f"ep={ep} does not divide the {shard} rank(s) FSDP2 shards over"
                              f"{' (a node, under HSDP)' if replicate > 1 else ''}: use an ep that divides them")
        if cp > 1 and parallel != "fsdp":
            raise MemfitError(f"cp={cp} needs parallel=fsdp: context parallel splits the sequence over ranks of an "
                              "FSDP2 group, which reduces their gradients (--parallel fsdp)")
        if cp > 1 and ep > 1:
            raise MemfitError(f"cp={cp} and ep={ep} conflict: memfit does not lay out context and expert parallel on "
                              "one mesh yet; drop one")
        if cp > 1 and shard % cp:
            raise MemfitError(f"cp={cp} does not divide the {shard} rank(s) FSDP2 shards over"
                              f"{' (a node, under HSDP)' if replicate > 1 else ''}: use a cp that divides them")
        return cls(world, pp, replicate, shard, tp, ep, cp)

    @property
    def dp(self) -> int:
        return self.replicate * self.shard

    @property
    def rows_split(self) -> int:
        """The ranks that read different rows of a batch: the data-parallel ones less context-parallel peers."""
        return self.dp // self.cp

    def data_rank(self, rank: int) -> int:
        """Which of the ``rows_split`` parts of the batch ``rank`` reads."""
        at = self.coords(rank)
        return at["replicate"] * (self.shard // self.cp) + at["shard"] // self.cp

    @property
    def sizes(self) -> tuple:
        return (self.pp, self.replicate, self.shard, self.tp)

    def coords(self, rank: int) -> dict:
        """``rank``'s index along each dimension."""
        out = {}
        for name, size in reversed(tuple(zip(self.NAMES, self.sizes))):
            rank, out[name] = divmod(rank, size)
        return {name: out[name] for name in self.NAMES}

    def rank(self, **coords) -> int:
        """The rank at these coordinates (0 along the dimensions not given)."""
        out = 0
        for name, size in zip(self.NAMES, self.sizes):
            out = out * size + coords.get(name, 0)
        return out

    def describe(self) -> str:
        parts = [f"pp={self.pp}"] if self.pp > 1 else []
        shard = self.shard // self.cp  # (context-parallel peers are listed as cp)
        if self.replicate * shard > 1:
            parts.append(f"dp={shard}" if self.replicate == 1 else
                         f"dp={self.replicate}x{shard} (replicate x shard)")
        if self.tp > 1:
            parts.append(f"tp={self.tp}")
        if self.ep > 1:
            parts.append(f"ep={self.ep} (experts)")
        if self.cp > 1:
            parts.append(f"cp={self.cp} (sequence)")
        return " x ".join(parts) or "1 rank"

    def device_mesh(self, device: str):
        """The whole mesh, every dimension named (size 1 included), made of real rank tensors outside every
        dispatch mode of an estimate: a slice finds this rank's row with nonzero(), which under the estimate's
        modes read row 0 (a stage past the first held empty shards)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            if self.cp > 1:
                mesh = init_device_mesh(device, (self.pp, self.replicate, self.shard // self.cp, self.cp, self.tp),
                                        mesh_dim_names=("pp", "replicate", "dp_shard", "cp", "tp"))
                mesh["dp_shard", "cp"]._flatten("shard")  # FSDP2's dimension (torchtitan's dp_shard_cp)
                return mesh
            if self.ep == 1:
                return init_device_mesh(device, self.sizes, mesh_dim_names=self.NAMES)
            mesh = init_device_mesh(device, (self.pp, self.replicate, self.shard // self.ep, self.ep, self.tp),
                                    mesh_dim_names=("pp", "replicate", "efsdp", "ep", "tp"))
            mesh["efsdp", "ep"]._flatten("shard")  # the dense blocks' FSDP2 dimension
            return mesh

    @staticmethod
    def data_parallel(mesh):
        """FSDP2's mesh of a whole mesh: the shard dimension, with the replicate one before it under HSDP."""
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes(), warnings.catch_warnings():
            # under expert parallel "shard" is efsdp x ep flattened (device_mesh): torch 2.13 slices it from the
            # root with a notice that a later torch wants the flattened mesh kept by hand; it is the same mesh
            warnings.filterwarnings("ignore", "Slicing a flattened dim")
            return mesh["shard"] if mesh["replicate"].size() == 1 else mesh["replicate", "shard"]

    @staticmethod
    def experts(mesh):
        """FSDP2's mesh for an expert-parallel MoE layer's experts: ``efsdp`` (the copies of each expert in an FSDP2
        group), with the replicate dimension before it under HSDP."""
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            return mesh["efsdp"] if mesh["replicate"].size() == 1 else mesh["replicate", "efsdp"]


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
    hook = sys.excepthook  # init_process_group wraps it to prefix "[rank0]: " (again for each fake world)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world.size)
    token = None
    try:
        token = _CURRENT.set(_placement(world, rank, fake=True))
        yield _CURRENT.get()
    finally:
        if token is not None:
            _CURRENT.reset(token)
        dist.destroy_process_group()
        sys.excepthook = hook
        forget_meshes()


def forget_meshes() -> None:
    """Drop DTensor's caches of sharding and redistribution plans: they are keyed by meshes that compare equal
    across fake worlds (same ranks, same names) but hold the process groups of the world that made them, which
    the next rank's world no longer has ("could not resolve the process group")."""
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor import _redistribute
    except ImportError:
        return
    propagator = DTensor._op_dispatcher.sharding_propagator
    for cached in (propagator.propagate_op_sharding, getattr(propagator, "_propagate_tensor_meta_cached", None),
                   getattr(_redistribute, "_gen_transform_infos", None)):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    if hasattr(_redistribute, "clear_redistribute_planner_cache"):
        _redistribute.clear_redistribute_planner_cache()
    import torch

    if hasattr(torch._C, "_clear_DTensor_sharding_propagator_cache"):  # the C++ dispatch fast path's own cache
        torch._C._clear_DTensor_sharding_propagator_cache()


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
