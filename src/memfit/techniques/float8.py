"""Float8 training (``Recipe(float8="tensorwise"|"rowwise")``): torchao's ``convert_to_float8_training``.

Every ``nn.Linear`` of the model but the output head (and any whose dimensions are not multiples of 16, which
float8 matmuls cannot take) becomes torchao's ``Float8Linear``: its input, weight and output gradient are cast to
float8 with a scale (one per tensor, or one per row with ``rowwise``) for each matmul, as torchtitan's
``--model.converters float8`` does. The weights, gradients and optimizer state stay in the model's dtype; what
changes is each matmul's operands (1-byte copies and their scales live for the matmul, and the casts' fp32
temporaries) and what backward saves. On a CPU torchao emulates the float8 matmul (``emulate=True``:
dequantised to the high precision, then multiplied), which is what the CPU truth runs; on CUDA semantics it
calls ``torch._scaled_mm`` on cards with float8 units.

The ledger sees the casts and the emulated matmul inside ``Float8TrainingTensor``'s own dispatch
(``accounting/subclasses.py``: ``wrapper_handler``). It changes the math (float8 operands): it is the user's choice by name
(``--float8 rowwise``), which ``plan`` keeps fixed; it does not search it (its cost model has no float8 matmul
rate yet). Not yet: FSDP2's float8 all-gather (``enable_fsdp_float8_all_gather``),
float8 with TP, LoRA or compile (each one error).
"""

from __future__ import annotations

from memfit.errors import MemfitError
from memfit.techniques.spec import Field, Technique

__all__ = ["TECHNIQUE", "FLOAT8", "convert"]

FLOAT8 = ("off", "tensorwise", "rowwise")


def _skip(module, name: str) -> bool:
    """torchtitan's filter: the output head stays in high precision, and float8 matmuls need both dimensions of a
    linear to be multiples of 16."""
    import torch

    if not isinstance(module, torch.nn.Linear):
        return True
    if name.split(".")[-1] in ("lm_head", "output", "score", "classifier"):
        return True
    return module.in_features % 16 != 0 or module.out_features % 16 != 0


def convert(model, recipe_name: str, emulate: bool) -> int:
    """``model``'s linears converted to torchao's ``Float8Linear`` (``recipe_name``: tensorwise, rowwise); how many."""
    import dataclasses

    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        raise MemfitError(f"float8={recipe_name} needs torchao (pip install torchao): {err}") from None
    config = Float8LinearConfig.from_recipe_name(recipe_name)
    if emulate:
        config = dataclasses.replace(config, emulate=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, name: not _skip(m, name))
    converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    if not converted:
        raise MemfitError(f"float8={recipe_name}: the model has no linear layer float8 can take (both dimensions "
                          "multiples of 16, not the output head); use float8=off")
    return converted


def _apply(build) -> None:
    mode = build.recipe.float8
    if mode == "off":
        return
    convert(build.model, mode, emulate=build.device_type != "cuda")


def _conflicts(recipe):
    if recipe.float8 == "off":
        return
    for name, clashes in (("lora", lambda r: r.lora != "off"), ("tp", lambda r: r.tp > 1),
                          ("compile", lambda r: r.compile), ("precision", lambda r: r.precision == "fp16-mixed")):
        if clashes(recipe):
            yield (f"float8={recipe.float8} and {name}={getattr(recipe, name)} conflict: memfit has not checked that "
                   "pair against real runs yet; drop one")
            return


TECHNIQUE = Technique(
    name="float8",
    fields=(Field("float8", "off", "torchao float8 training: every linear but the head multiplies float8 copies of "
                  "its operands (tensorwise or rowwise scales); changes the math: allowed by name", slot=140,
                  choices=FLOAT8),),
    order=12, apply=_apply, conflicts=_conflicts,
    approximations=lambda r: [f"float8={r.float8}"] if r.float8 != "off" else [],
    trace="both")
