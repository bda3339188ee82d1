"""Parameter counts of the catalog's models: total, and active per token for mixtures of experts.

A count is read off the model itself, built on the meta device (shapes, no storage: DeepSeek-V3's
671B parameters build in about two seconds). The active count is memfit's own: every parameter
outside the routed experts, plus the ``top_k / experts`` share of each fused expert bank
(transformers' ``*Experts`` modules hold all experts of a layer in one tensor, experts first).
Shared experts, routers and embeddings are always active. Publishers do not all count the same
way (OpenAI's active count leaves out the input embedding), which the catalog entry says where it
matters (``published_active_excludes``).

``memfit models`` must answer in well under a second, so the counts are not computed there but read
from ``configs/_counts.json``, written by :func:`write_table` (``python -m memfit.models.counts``)
and checked against fresh builds by ``tests/test_catalog.py``, so the table cannot go stale.

Left out: multi-token-prediction layers (DeepSeek-V3, GLM-4.5) that transformers does not build.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from memfit.errors import MemfitError

if TYPE_CHECKING:  # torch is imported where a model is built: ``memfit models`` reads the table only
    import torch

__all__ = ["Counts", "build_meta", "count", "count_module", "table", "write_table", "TABLE", "parse_count",
           "format_count"]

TABLE = Path(__file__).with_name("configs") / "_counts.json"


@dataclass(frozen=True)
class Counts:
    params: int  # every parameter, tied weights once
    active: int | None  # per token: outside the routed experts + top_k/experts of them; None when dense


def build_meta(model_type: str, config: dict, task: str = "causal-lm") -> torch.nn.Module:
    """The model of a catalog entry on the meta device (no storage, no initialisation cost)."""
    import torch
    import transformers
    from transformers import AutoConfig

    from memfit.models import tasks

    auto = getattr(transformers, tasks.AUTO_CLASSES[task])
    with torch.device("meta"):
        return auto.from_config(AutoConfig.for_model(model_type, **config))


def count_module(model: torch.nn.Module, top_k: int | None = None, exclude: tuple = ()) -> Counts:
    """Counts of a built model. ``top_k``: experts each token is routed to (the config's
    ``num_experts_per_tok``); ``exclude``: parameter-name prefixes left out of the active count."""
    total = active = 0
    routed, seen = False, set()
    for name, module in model.named_modules():
        own = [(f"{name}.{n}" if name else n, p) for n, p in module.named_parameters(recurse=False)
               if id(p) not in seen and not seen.add(id(p))]  # a tied weight counts once
        banked = type(module).__name__.endswith("Experts") and top_k and own and own[0][1].dim() == 3
        for full, param in own:
            total += param.numel()
            if any(full.startswith(prefix) for prefix in exclude):
                continue
            if banked:  # [experts, ...] (a bias too: [experts, width])
                routed = True
                active += param.numel() * top_k // param.shape[0]
            else:
                active += param.numel()
    return Counts(total, active if routed else None)


def count(model_type: str, config: dict, task: str = "causal-lm", exclude: tuple = ()) -> Counts:
    model = build_meta(model_type, config, task)
    top_k = getattr(model.config.get_text_config(), "num_experts_per_tok", None)
    return count_module(model, top_k, exclude)


@lru_cache(maxsize=1)
def table() -> dict[str, Counts]:
    """The stored counts, by catalog name (empty if the table was never written)."""
    if not TABLE.exists():
        return {}
    return {name: Counts(*pair) for name, pair in json.loads(TABLE.read_text()).items()}


def fresh() -> dict[str, Counts]:
    """Every catalog entry counted now (a few seconds: the largest build on meta takes ~2 s)."""
    from memfit.models.catalog import CATALOG

    return {name: count(e.model_type, e.config, e.task) for name, e in CATALOG.items()}


def write_table() -> None:
    counts = fresh()
    lines = [f'  "{name}": [{c.params}, {"null" if c.active is None else c.active}]' for name, c in counts.items()]
    TABLE.write_text("{\n" + ",\n".join(lines) + "\n}\n")
    table.cache_clear()


_SCALE = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str | int) -> int:
    """A parameter count written as people write it: ``10B``, ``500M``, ``1.5T``, ``7e9``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:e\d+)?)\s*([kmbgt]?)\s*", str(text).lower())
    if match is None:
        raise MemfitError(f"cannot read parameter count {text!r}: write it like 10B, 500M or 7e9")
    return int(float(match.group(1)) * _SCALE[match.group(2)])


def format_count(n: int | None) -> str:
    """``8030261248`` -> ``8.03B``; three significant figures, ``-`` for none."""
    if n is None:
        return "-"
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale * 0.9995:  # 999.9M reads as 1.00B
            value = n / scale
            return f"{value:.{max(0, 2 - int(math.log10(value)))}f}{unit}"
    return str(n)


if __name__ == "__main__":
    write_table()
    print(f"wrote {TABLE}")
