"""Plans kept on disk, so that a rerun or a resumed ``memfit train`` starts without planning again.

A plan is keyed by everything its answer depends on: the model's config (its JSON, not its name: a
changed config is a new key), the fields the user fixed and the approximations allowed, the budget,
the card and device, the global batch and sequence length, the optimizer, and the versions of memfit,
torch and transformers (a new version may estimate differently). The value is the chosen recipe with
its predicted bytes and speed, written atomically (a temporary file renamed over), one JSON file a key,
under ``$MEMFIT_CACHE`` or ``~/.cache/memfit`` (``plans/``). A file that cannot be read is a miss;
one that cannot be written is skipped with a note: the run never fails for its cache.

Why by hand: the answer is a few hundred bytes of JSON under a hash, which ``json`` and ``os.replace``
do; ``functools.lru_cache`` does not outlive the process, and ``torch``'s and ``huggingface_hub``'s
caches keep their own artefacts, not ours.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from memfit.planner.result import Plan
from memfit.techniques.recipe import Recipe

__all__ = ["CACHE_ENV", "cache_dir", "plan_key", "load_plan", "save_plan"]

CACHE_ENV = "MEMFIT_CACHE"
FORMAT = 3  # bumped when the stored fields change
_PLAN_FIELDS = ("allocated_bytes", "reserved_bytes", "device_bytes", "step_seconds", "samples_per_second",
                "tokens_per_second", "verified", "verdict", "seq_len")


def cache_dir() -> Path:
    base = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "memfit")
    return Path(base) / "plans"


def _model_identity(source) -> str:
    config = getattr(source, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        return config.to_json_string(use_diff=False)
    return str(getattr(source, "name", source))


def plan_key(source, **question) -> str:
    """A hex digest of the model's identity, ``question`` (JSON-able: budget, card, batch, fixed
    fields, ...) and the library versions."""
    import torch

    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:  # a plain nn.Module model
        tf_version = None
    body = json.dumps({"format": FORMAT, "model": _model_identity(source), "question": question,
                       "versions": [_version(), torch.__version__, tf_version]}, sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:32]


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("memfit")
    except metadata.PackageNotFoundError:  # a source tree on sys.path: memfit is loaded already
        import sys

        return getattr(sys.modules.get("memfit"), "__version__", "unknown")


def load_plan(key: str) -> dict | None:
    """The stored plan of ``key`` ({"recipe": Recipe, "plan": Plan, ...}), or None."""
    path = cache_dir() / f"{key}.json"
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        data["recipe"] = Recipe.from_dict(data["recipe"])
        data["plan"] = Plan(recipe=data["recipe"], **{k: data[k] for k in _PLAN_FIELDS})
        return data
    except (OSError, ValueError, KeyError, TypeError):
        return None
    except Exception:  # noqa: BLE001 - a stored recipe this memfit refuses (a field renamed): a miss
        return None


def save_plan(key: str, plan, **extra) -> str | None:
    """Store ``plan`` (a ``Plan``) under ``key``; the path, or None where it could not be written."""
    folder = cache_dir()
    data = {"recipe": plan.recipe.to_dict(), "describe": plan.recipe.describe(),
            **{k: getattr(plan, k) for k in _PLAN_FIELDS}, **extra}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, folder / f"{key}.json")
        return str(folder / f"{key}.json")
    except OSError:
        return None
