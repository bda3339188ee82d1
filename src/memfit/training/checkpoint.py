"""Checkpoints a crash cannot corrupt: written aside, flushed to disk, then renamed into place.

A checkpoint is a directory ``step-000123`` under the run's directory holding ``model.safetensors``
(the weights, through safetensors, tied weights kept once) and ``state.pt`` (optimizer, scaler,
scheduler, RNG states, data position and anything else the loop passes; loaded with
``torch.load(weights_only=True)``, so a checkpoint cannot run code). Both are written into a
``.partial-*`` directory, each file and the directory fsynced, and the directory renamed to its
final name: a rename is atomic on POSIX, so a ``step-*`` directory is either complete or absent,
whenever the process is killed. Old checkpoints beyond ``keep`` are removed only after the new one
is in place, and partial directories left by a killed run are removed by the next save.

Why by hand: ``torch.distributed.checkpoint`` writes in place (a kill mid-write leaves a torn
checkpoint that it cannot tell from a good one), and safetensors alone holds no optimizer state.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path

import torch

from memfit.errors import MemfitError

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "rng_state", "set_rng_state"]

_NAME = re.compile(r"^step-(\d{9})$")
WEIGHTS, STATE = "model.safetensors", "state.pt"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoints(out_dir) -> list[tuple[int, Path]]:
    """The complete checkpoints under ``out_dir``, oldest first."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out_dir.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return sorted(found)


def latest_checkpoint(out_dir) -> Path | None:
    """The newest complete checkpoint under ``out_dir``, or None."""
    found = checkpoints(out_dir)
    return found[-1][1] if found else None


def save_checkpoint(out_dir, step: int, model: torch.nn.Module, state: dict, *, keep: int = 2) -> Path:
    """Write ``model``'s weights and ``state`` as checkpoint ``step``; keep the newest ``keep``."""
    from safetensors.torch import save_model

    if keep < 1:
        raise MemfitError(f"keep must be at least 1 checkpoint, got {keep}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob(".partial-*"):  # left by a run killed while saving
        shutil.rmtree(stale, ignore_errors=True)
    final = out_dir / f"step-{step:09d}"
    partial = out_dir / f".partial-{step:09d}-{os.getpid()}"
    partial.mkdir()
    save_model(model, str(partial / WEIGHTS))
    torch.save(state, partial / STATE)
    for name in (WEIGHTS, STATE):
        _fsync(partial / name)
    return commit(partial, final, keep)


def commit(partial: Path, final: Path, keep: int) -> Path:
    """``partial`` (every file in it fsynced) renamed to ``final`` atomically; checkpoints beyond the
    newest ``keep`` removed after."""
    _fsync(partial)
    if final.exists():  # the same step saved again (a resumed run): replace it whole
        shutil.rmtree(final)
    os.rename(partial, final)
    _fsync(final.parent)
    for _, old in checkpoints(final.parent)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path, model: torch.nn.Module) -> dict:
    """Load the weights of checkpoint ``path`` into ``model``; return its state (weights_only)."""
    from safetensors.torch import load_model

    path = Path(path)
    if not (path / WEIGHTS).is_file() or not (path / STATE).is_file():
        raise MemfitError(f"{path} is not a memfit checkpoint (no {WEIGHTS} and {STATE}): point at a step-* directory")
    missing, unexpected = load_model(model, str(path / WEIGHTS), strict=False)
    if missing or unexpected:
        raise MemfitError(f"checkpoint {path} does not match the model ({len(missing)} missing, {len(unexpected)} "
                          f"unexpected weights, e.g. {(list(missing) + list(unexpected))[0]}): resume with the same model")
    return torch.load(path / STATE, weights_only=True)


def rng_state() -> dict:
    """Every random generator a training loop draws from, as weights_only-loadable values."""
    state = {"torch": torch.get_rng_state(), "python": _python_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = {"keys": torch.from_numpy(keys.astype("int64")), "pos": pos, "has_gauss": has_gauss,
                          "gauss": gauss}
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _python_state():
    version, internal, gauss = random.getstate()
    return {"version": version, "internal": list(internal), "gauss": gauss}


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` saved."""
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        np.random.set_state(("MT19937", n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
