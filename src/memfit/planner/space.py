"""The planner's search space: every candidate recipe ``plan`` predicts.

The axes are the techniques' own (precision x LoRA x checkpointing x activation offload x chunked
loss x optimizer x optimizer-in-backward x micro-batch / accumulation); a pair ``Recipe`` rejects is
skipped. Techniques that change the math are searched only when ``allow`` names them.
"""

from __future__ import annotations

import math

from memfit.errors import MemfitError, shown
from memfit.techniques.recipe import Recipe

__all__ = ["ALLOWABLE", "allowed_names", "search_space", "divisors"]

#: What ``allow`` may name: techniques that change the math and are never chosen otherwise.
ALLOWABLE = ("lora", "qlora", "adamw8bit", "paged_adamw8bit", "bf16")
#: every N-th block checkpointed: the values of N tried (where N < depth)
EVERY = (2, 3, 4, 6, 8, 16)
LORA_RANK = 16
CHUNKS = 8


def allowed_names(allow) -> set[str]:
    if allow is None:
        return set()
    if isinstance(allow, str):
        allow = [a for a in allow.split(",") if a.strip()]
    try:
        names = {str(a).strip().lower() for a in allow}
    except TypeError:
        raise MemfitError(f"allow takes names, e.g. allow='lora,adamw8bit', got {shown(allow)}") from None
    unknown = sorted(names - set(ALLOWABLE))
    if unknown:
        raise MemfitError(f"cannot allow {', '.join(shown(u, 30) for u in unknown)}: allow takes {', '.join(ALLOWABLE)}")
    return names


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]  # pairs (d, n // d): sqrt(n) steps
    return sorted(set(small + [n // d for d in small]))


def search_space(engine, allowed: set[str], optimizer: str) -> list[Recipe]:
    """Every candidate recipe; pairs ``Recipe`` rejects are skipped."""
    target = engine.target
    low = "bf16-mixed" if target is None or target.bf16 else "fp16-mixed"
    bf16_ok = target is None or target.bf16  # pure bf16 needs bf16 units (sm80+)
    precisions = ["fp32", low] + (["bf16"] if "bf16" in allowed and bf16_ok else [])
    depth = engine.depth or 0
    levels = ["off", "selective", "blocks"] + [f"blocks:{n}" for n in EVERY if n < depth] if engine.has_blocks \
        else ["off"]
    chunked = [0, CHUNKS] if engine.causal_lm else [0]
    optimizers = [optimizer] + [o for o in ("adamw8bit", "paged_adamw8bit") if o in allowed and o != optimizer]
    loras = ["off"] + [f"{k}:{LORA_RANK}" for k in ("lora", "qlora") if k in allowed]
    gbs = engine.global_batch_size
    out = []
    for precision in precisions:
        for lora in loras:
            for level in levels:
                for offload in ([False, True] if target is not None and level != "selective" else [False]):
                    for chunks in chunked:
                        for opt in optimizers:
                            for mb in divisors(gbs):
                                for in_backward in (False, True):
                                    if in_backward and mb != gbs:
                                        continue
                                    try:
                                        out.append(Recipe(precision=precision, checkpointing=level,
                                                          offload_activations=offload, chunked_loss=chunks,
                                                          optimizer=opt, optimizer_in_backward=in_backward,
                                                          micro_batch_size=mb, grad_accum_steps=gbs // mb,
                                                          lora=lora))
                                    except MemfitError:
                                        continue
    return out
