"""What training a checkpoint stored quantised means (``quantization_config``: ``models/quantized.py``).

A 4-bit checkpoint (bitsandbytes NF4/FP4, GPTQ or AWQ int4) cannot be trained as stored: its weights
are frozen integers. LoRA over it is QLoRA, estimated as memfit models QLoRA (a frozen bitsandbytes
NF4 base, bf16 compute), with the checkpoint's own stored bytes beside. Every other case (no adapters,
8-bit, FP8, MXFP4) trains the weights dequantised, as transformers loads them for training (gpt-oss's
``Mxfp4Config(dequantize=True)``, FP8's dequantisation), in the recipe's precision. Either way the
report says so (``checkpoint``, a note); nothing that changes the math is chosen without the user
asking for adapters.
"""

from __future__ import annotations

import torch

from memfit.errors import MemfitError
from memfit.models.quantized import stored_bytes
from memfit.techniques.lora import lora_plan
from memfit.techniques.recipe import Recipe
from memfit.units import format_size

__all__ = ["checkpoint_recipe", "with_checkpoint", "dequantised"]


def checkpoint_recipe(source, recipe: Recipe, workload: str = "train") -> tuple[Recipe, dict | None]:
    """The recipe a quantised checkpoint is estimated with, and the report's ``checkpoint`` entry."""
    q = source.quantization
    if q is None:
        return recipe, None
    with torch.device("meta"):
        stored = stored_bytes(source.build(), q)
    kind, rank = lora_plan(recipe.lora)
    if workload != "train":
        how = "dequantised (memfit runs the forward in the recipe's precision)"
    elif kind in ("lora", "qlora") and q.four_bit_base:
        if recipe.precision in ("fp32", "fp16-mixed"):
            raise MemfitError(f"{source.name} stores {q.label} weights: LoRA over them is QLoRA, which computes in "
                              f"bf16; add precision bf16-mixed (--precision bf16-mixed)")
        recipe = recipe.replace(lora=f"qlora:{rank}")
        how = (f"LoRA over the frozen 4-bit base: estimated as QLoRA (bitsandbytes NF4) at rank {rank}"
               if q.method != "bitsandbytes" else f"QLoRA at rank {rank} over the stored base")
    elif kind == "qlora":
        how = f"dequantised, then quantised again to NF4 by qlora:{rank}"
    else:
        adapters = "LoRA over " if kind == "lora" else ""
        how = f"{adapters}the weights dequantised to the recipe's precision ({recipe.precision})"
        if q.four_bit_base and kind == "off":
            how += "; to train over the stored 4-bit base add lora (e.g. --lora lora:16)"
    return recipe, {"format": q.label, "method": q.method, "bits": q.bits, "stored_weight_bytes": stored,
                    "training": how}


def with_checkpoint(source, report, checkpoint: dict | None):
    """``report`` with where the model came from (``source.notes``), the checkpoint's entry and its note."""
    import dataclasses

    notes = list(source.notes)
    if checkpoint is not None:
        notes.append(f"checkpoint stored as {checkpoint['format']} ({format_size(checkpoint['stored_weight_bytes'])} "
                     f"of weights): {checkpoint['training']}")
    return dataclasses.replace(report, checkpoint=checkpoint, notes=report.notes + notes) if notes else report


def dequantised(source) -> tuple[object, str | None]:
    """``source`` without its stored format, and a note saying so (None for a plain one): what the
    planner searches, where adapters are its own choice (``allow=``)."""
    import dataclasses

    q = source.quantization
    if q is None:
        return source, None
    return dataclasses.replace(source, quantization=None), (
        f"{source.name} is stored as {q.label}: planned with the weights dequantised; estimate a recipe with lora "
        "over it to see training over the stored base")
