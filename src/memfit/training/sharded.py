"""Sharded checkpoints of a data-parallel run, committed atomically, resumable at any world size.

Each rank writes its own shards of the weights and optimizer state with
``torch.distributed.checkpoint`` (DCP: ``get_state_dict`` gives FSDP2's DTensor shards, or DDP's
full tensors, keyed by the unwrapped model's names), into ``.partial-<step>`` under the run's
directory. After every rank's ``dcp.save`` returned (DCP ends with a barrier), each rank's RNG
state goes to ``rng-<rank>.pt``, every file is fsynced, and rank 0 writes ``state.pt`` (scheduler,
data position, the micro-batch scale: the same on every rank), fsyncs, renames the directory to
``step-<step>`` and removes checkpoints beyond ``keep``; a barrier ends the save. A rank killed at
any moment leaves either a complete ``step-*`` directory or a ``.partial-*`` one that the next save
removes, as the one-process checkpoints do (``checkpoint.py``).

Loading goes through DCP's planner, which reshards: a checkpoint written by 2 ranks loads into 1
(plain tensors, no process group) or 4 (their shards). ``export_safetensors`` writes the full
weights to one ``model.safetensors`` for Hugging Face (``from_pretrained`` reads it).

Why by hand: DCP writes in place and has no commit step; the rename is what makes a kill harmless.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from memfit.errors import MemfitError
from memfit.training.checkpoint import STATE, _fsync, commit

__all__ = ["save_sharded", "load_sharded", "is_sharded", "export_safetensors", "METADATA"]

METADATA = ".metadata"  # DCP's index file


def is_sharded(path) -> bool:
    """Whether checkpoint ``path`` was written by DCP (a data-parallel run)."""
    return (Path(path) / METADATA).is_file()


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _barrier(dist) -> None:
    if dist is not None:
        dist.barrier()


def save_sharded(out_dir, step: int, model, opt, state: dict, rng: dict, *, keep: int = 2) -> Path:
    """Checkpoint ``step`` of a data-parallel run (every rank calls this); see the module docstring."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if keep < 1:
        raise MemfitError(f"keep must be at least 1 checkpoint, got {keep}")
    dist = _dist()
    rank = dist.get_rank() if dist is not None else 0
    out_dir = Path(out_dir)
    final, partial = out_dir / f"step-{step:09d}", out_dir / f".partial-{step:09d}"
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        for stale in out_dir.glob(".partial-*"):  # left by a run killed while saving
            shutil.rmtree(stale, ignore_errors=True)
        partial.mkdir()
    _barrier(dist)
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(partial))
    torch.save(rng, partial / f"rng-{rank}.pt")
    for path in partial.iterdir():
        if path.name.startswith(f"__{rank}_") or path.name == f"rng-{rank}.pt" or (rank == 0 and path.name == METADATA):
            _fsync(path)
    _barrier(dist)
    if rank == 0:
        torch.save(state, partial / STATE)
        _fsync(partial / STATE)
        commit(partial, final, keep)
    _barrier(dist)
    return final


def load_sharded(path, model, opt) -> tuple[dict, dict | None]:
    """Load checkpoint ``path`` into ``model`` and ``opt`` (resharded to this world); returns its
    ``state.pt`` and this rank's RNG state (None when the writing run had fewer ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    if not is_sharded(path) or not (path / STATE).is_file():
        raise MemfitError(f"{path} is not a sharded memfit checkpoint (no {METADATA} and {STATE}): point at a "
                          "step-* directory")
    dist = _dist()
    model_state, optim_state = get_state_dict(model, opt)
    target = {"model": model_state, "optimizer": optim_state}
    try:
        dcp.load(target, checkpoint_id=str(path), no_dist=dist is None)
    except (RuntimeError, KeyError, ValueError) as err:
        raise MemfitError(f"checkpoint {path} does not match the model or optimizer "
                          f"({str(err).splitlines()[0][:200]}): resume with the same model and recipe") from None
    set_state_dict(model, opt, model_state_dict=target["model"], optim_state_dict=target["optimizer"])
    rank = dist.get_rank() if dist is not None else 0
    rng = path / f"rng-{rank}.pt"
    return (torch.load(path / STATE, weights_only=True),
            torch.load(rng, weights_only=True) if rng.is_file() else None)


def export_safetensors(model, out) -> Path | None:
    """The full weights of a (sharded or replicated) ``model`` as one safetensors file at ``out``,
    written by rank 0 (every rank calls this: the shards are gathered); names as the unwrapped
    model's, a tied weight kept once. Returns the path on rank 0, None elsewhere."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    dist = _dist()
    if dist is not None and dist.get_rank() != 0:
        return None
    seen, kept = set(), {}
    for name, tensor in full.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        kept[name] = tensor.detach().contiguous()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial")
    save_file(kept, str(partial), metadata={"format": "pt"})
    _fsync(partial)
    os.replace(partial, out)
    return out
