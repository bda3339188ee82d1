"""FSDP2 sharding a model (``fully_shard``) for ``parallel=fsdp``: its values, its units, and what it takes to run
on fake tensors over a fake world.

``reshard_value`` and ``mixed_dtypes`` read the recipe's ``reshard_after_forward`` and ``mixed_precision`` as FSDP2
takes them; ``shard`` wraps the modules ``shard_modules`` names (torchtune's ``custom_sharded_layers``, torchtitan's
embedding and head), then every repeated block, then the root, as torchtune's ``shard_model`` wraps (``_units``: the
blocks wrapped on their own), with FSDP2's ``MixedPrecisionPolicy`` and ``CPUOffloadPolicy``. Two of FSDP2's
internals are patched while it shards, and only then: the smaller mesh of a partial reshard is made with the fake
mode lifted (``_mesh_outside_fake``), and a parameter's per-rank chunks are made when read (``_lazy_chunks``: a fake
world has thousands of ranks). Left out: the technique's fields and conflicts (``parallel.py``), FSDP2's tensors
during the step (``fsdp_step.py``) and DDP (``ddp.py``).
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter

from memfit.errors import MemfitError, shown
from memfit.techniques.expert_parallel import shard_experts

__all__ = ["reshard_value", "mixed_dtypes", "module_names", "shard"]

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


def module_names(value) -> tuple[str, ...]:
    """``shard_modules`` as names: a module's name or a dotted tail of it (``output``, ``model.embed_tokens``)."""
    names = tuple(n.strip() for n in str(value).split(",") if n.strip())
    bad = next((n for n in names if not re.fullmatch(r"[A-Za-z_0-9]+(\.[A-Za-z_0-9]+)*", n)), None)
    if bad is not None:
        raise MemfitError(f"shard_modules {shown(value)} not understood: give module names separated by commas, "
                          "e.g. tok_embeddings,output (as model.named_modules() names them)")
    return names


def shard(build, place) -> None:
    """``build``'s model sharded by FSDP2 over ``place``'s mesh (within a node, or over every rank), as its
    recipe says: policies, reshard and offload."""
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

    from memfit.techniques._qlora import NF4_GROUP
    from memfit.techniques.checkpointing import find_blocks

    mesh = place.mesh if build.recipe.shard_over == "node" else place.flat
    shards = mesh.shape[-1]
    for name, p in build.model.named_parameters():  # torchao's NF4 splits only whole groups of its codes per rank
        if type(p).__name__ == "NF4Tensor" and (p.shape[0] % shards or p.numel() % (shards * NF4_GROUP)):
            raise MemfitError(f"parallel=fsdp over {shards} ranks cannot shard {name} in torchao's NF4: each rank's share "
                              f"of its {p.numel()} weights must be whole {NF4_GROUP}-weight groups; use fewer GPUs, or "
                              "leave it out with quantize_targets")
    uneven = next((name for name, p in build.model.named_parameters() if p.dim() and p.shape[0] % shards), None)
    if uneven is not None:
        place.notes["uneven"] = uneven  # the last rank's shards are smaller: estimate.py traces it too
    # a rank's pipeline stages under a looped schedule each run on their own: each is a root, as torchtitan
    # shards each model part (a root's all-gather runs in its own forward)
    stages = getattr(build.model, "stages", None)
    roots = list(stages) if isinstance(stages, torch.nn.ModuleList) else [build.model]
    names = module_names(build.recipe.shard_modules)
    _check_named(build.model, roots, names)
    for root in roots:
        blocks = _units(root, find_blocks(root))
        inner, outer = _named(root, names, blocks)
        for _, module in inner:  # named modules within or beside the blocks: wrapped before them
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy, offload_policy=offload)
        for experts in getattr(build, "experts", ()):  # expert parallel: each MoE layer's experts on their own
            shard_experts(experts, build, reshard, policy, offload)
        for _, block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy, offload_policy=offload)
        for _, module in outer:  # named modules holding blocks: after them, as FSDP2 nests (children first)
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy, offload_policy=offload)
        # The root (embeddings, head, final norm) takes FSDP2's default: kept gathered from forward to
        # backward (its backward comes first), as torchtitan and torchtune leave it.
        fully_shard(root, mesh=mesh, reshard_after_forward=None if blocks else reshard, mp_policy=policy,
                    offload_policy=offload)


def _matches(path: str, names) -> bool:
    return bool(path) and any(path == n or path.endswith("." + n) for n in names)


def _check_named(model, roots, names) -> None:
    """A name of ``shard_modules`` that no root of ``model`` has (each pipeline stage is one) is a one-line error."""
    missing = next((n for n in names if not any(_matches(p, (n,)) for r in roots for p, _ in r.named_modules())), None)
    if missing is not None:
        top = ", ".join(name for name, _ in model.named_children())
        raise MemfitError(f"shard_modules names {missing!r}, which this model does not have: name its modules "
                          f"as named_modules() does (the top ones: {top})")


def _named(root, names, blocks) -> tuple[list, list]:
    """The modules of ``root`` that ``shard_modules`` ``names``, each to be an FSDP2 unit of its own, innermost first
    as torchtune's ``shard_model`` walks (``reversed(named_modules())``): (those holding no block, those holding
    one); a block named is one already. A module sharing a weight with another is a one-line error."""
    matched = [(path, module) for path, module in root.named_modules() if _matches(path, names)]
    seen = Counter(id(p) for _, p in root.named_parameters(remove_duplicate=False))
    tied = next((path for path, module in matched if any(seen[id(p)] > 1 for p in module.parameters())), None)
    if tied is not None:
        raise MemfitError(f"shard_modules: {tied} shares a weight with another module (tied embeddings); a tied "
                          "weight stays in one FSDP2 unit: leave it out of shard_modules")
    units = {id(block) for _, block in blocks}
    named = [(path, module) for path, module in reversed(matched) if id(module) not in units]
    holds = [any(id(m) in units for m in module.modules()) for _, module in named]
    return [n for n, h in zip(named, holds) if not h], [n for n, h in zip(named, holds) if h]


def _units(model, blocks) -> list:
    """The blocks FSDP2 wraps on their own: the repeated ones (a model's ``_no_split_modules`` may name
    one-off modules, BERT's embeddings), less any holding a parameter tied to another module (a tied
    weight must be in one FSDP group: it stays with the root)."""
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
