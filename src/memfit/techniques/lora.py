"""LoRA through peft: the base weights freeze, small low-rank adapters train.

Memory: gradients and optimizer state exist only for the adapters (a few MiB instead of 12 bytes
per base parameter with AdamW); activations are about the same (the frozen layers still save
their inputs for the adapters' backward). Cost: slightly more compute per linear layer; the model
learns a low-rank update only, so the result differs from full fine-tuning: ``Recipe.is_exact``
is False and the planner uses it only when allowed by name.

Adapters go on every linear layer but the output head (peft's ``all-linear`` for Hugging Face
models; every ``nn.Linear`` but the last otherwise), rank ``r``, alpha ``2r``, no dropout.

On fake tensors peft's move of each new adapter to its base layer's device would swap a fake
parameter in place, which torch refuses; the adapters are built where the base already is, so the
move is skipped while wrapping.

QLoRA (``quantize_base`` then ``apply_lora``): the same linear layers first become bitsandbytes
``Linear4bit`` (NF4, double-quantised absmax, blocks of 64, bf16 compute): 0.5 byte per weight plus
about 0.02 for the quantisation state, instead of 2 or 4. The base weight is dequantised inside the
matmul kernel (forward) and once per layer in backward, so activations are about those of LoRA.
The quantisation happens before the first step (as loading a quantised checkpoint would), not
inside it. Left out on purpose: peft's ``prepare_model_for_kbit_training`` (it casts every other
weight to fp32 and turns on checkpointing by itself; here precision and checkpointing are the
recipe's own fields). Layers that are not ``nn.Linear`` (GPT-2's ``Conv1D``) stay unquantised; a model with no
adaptable ``nn.Linear`` at all (GPT-2) is refused, since QLoRA would quantise nothing.

On fake tensors bitsandbytes' ``Params4bit`` cannot wrap a FakeTensor (``_make_subclass``), so the
quantised weight stays a plain fake parameter carrying the same attributes; bitsandbytes' ops have
fake kernels, so the forward and backward run its real Python code.
"""

from __future__ import annotations

import contextlib
import re

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from memfit.errors import MemfitError, shown
from memfit.scoped import patched
from memfit.techniques.spec import Field, Technique

__all__ = ["apply_lora", "quantize_base", "quant_state_tensors", "lora_plan", "TECHNIQUE"]


@contextlib.contextmanager
def _no_moves(model):
    if not any(isinstance(p, FakeTensor) for p in model.parameters()):
        yield
        return
    with patched(torch.nn.Module, "to", lambda self, *args, **kwargs: self):
        yield


def _is_hf(model) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, PreTrainedModel)


def _linear_names(model) -> list[str]:
    """Every ``nn.Linear`` but the output head: the layers LoRA adapts and QLoRA quantises."""
    names = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    head = model.get_output_embeddings() if _is_hf(model) else None
    if head is not None:
        return [name for name in names if model.get_submodule(name) is not head]
    return names[:-1] or names


def _targets(model) -> list[str] | str:
    return "all-linear" if _is_hf(model) else _linear_names(model)


def apply_lora(model: torch.nn.Module, *, rank: int) -> torch.nn.Module:
    """``model`` wrapped by peft with LoRA adapters of rank ``rank``; the base is frozen."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise MemfitError("lora needs peft: pip install 'memfit[peft]'") from None
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=_targets(model))
    with _no_moves(model):
        return get_peft_model(model, config)


def _bnb():
    try:
        import bitsandbytes
        import bitsandbytes.functional as F
    except ImportError:
        raise MemfitError("qlora needs bitsandbytes: pip install 'memfit[bnb]'") from None
    with unset_fake_temporarily():  # bitsandbytes caches this table: it must be a real tensor
        if "dynamic" not in F.name2qmap:
            F.name2qmap["dynamic"] = F.create_dynamic_map()
    return bitsandbytes


def _fake_state(state, mode) -> None:
    """Make every real tensor of a ``QuantState`` (the cached code table) fake, as the step expects."""
    while state is not None:
        for name, value in vars(state).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
                setattr(state, name, mode.from_tensor(value))
        state = getattr(state, "state2", None)


@contextlib.contextmanager
def _fake_inputs_allowed(tensor):
    """bitsandbytes builds its NF4 code table as a new tensor; let the fake mode take it in."""
    mode = getattr(tensor, "fake_mode", None)
    if mode is None:
        yield
        return
    before, mode.allow_non_fake_inputs = mode.allow_non_fake_inputs, True
    try:
        yield
    finally:
        mode.allow_non_fake_inputs = before


def _quantized(linear: torch.nn.Linear, bnb) -> torch.nn.Module:
    kwargs = dict(compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4")
    with unset_fake_temporarily():
        layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                  device="meta", **kwargs)
    weight = linear.weight.detach()
    with torch.no_grad(), _fake_inputs_allowed(weight):
        packed, state = bnb.functional.quantize_4bit(weight, blocksize=64, compress_statistics=True,
                                                      quant_type="nf4")
    if isinstance(packed, FakeTensor):
        _fake_state(state, packed.fake_mode)
        param = torch.nn.Parameter(packed, requires_grad=False)  # a FakeTensor marked as a parameter
        for name, value in dict(blocksize=64, compress_statistics=True, quant_type="nf4",
                                quant_storage=torch.uint8, bnb_quantized=True, module=layer).items():
            setattr(param, name, value)
        param.quant_state = state
    else:
        param = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, blocksize=64,
                                  compress_statistics=True, quant_type="nf4", bnb_quantized=True, module=layer)
    layer._parameters["weight"] = param
    layer.quant_state = state
    if linear.bias is not None:  # Linear4bit casts its bias to the compute dtype on first use; do it now
        layer.bias = torch.nn.Parameter(linear.bias.detach().to(torch.bfloat16), requires_grad=False)
    layer.compute_type_is_set = True
    return layer


def quantize_base(model: torch.nn.Module) -> torch.nn.Module:
    """Replace the adaptable linear layers of ``model`` by 4-bit ones, in place (once).

    Already-quantised models (a bitsandbytes ``Linear4bit`` anywhere) are left as they are.
    """
    bnb = _bnb()
    if any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules()):
        return model
    names = _linear_names(model)
    if not names:
        raise MemfitError(f"qlora found no nn.Linear layers to quantise in {type(model).__name__} (layers such as "
                          "GPT-2's Conv1D are not nn.Linear): use lora instead")
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, _quantized(getattr(owner, child), bnb))
    return model


def quant_state_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The 4-bit layers' quantisation statistics: memory that is neither a parameter nor a buffer."""
    found = []
    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        while state is not None:
            found += [t for t in (state.absmax, state.code, getattr(state, "offset", None))
                      if isinstance(t, torch.Tensor)]
            state = getattr(state, "state2", None)
    return found


MAX_LORA_RANK = 65536
SEARCH_RANK = 16  # the rank the planner tries when LoRA/QLoRA is allowed


def lora_plan(value) -> tuple[str, int]:
    """("off" | "lora" | "qlora", rank) of a ``lora`` value."""
    kind, _, rank = value.partition(":") if isinstance(value, str) else ("", "", "")
    if kind not in ("off", "lora", "qlora") or (kind == "off" and rank) \
            or (rank and not (re.fullmatch(r"[0-9]{1,9}", rank) and 1 <= int(rank) <= MAX_LORA_RANK)):
        raise MemfitError(f"lora {shown(value)} not understood: use off, lora, lora:16 or qlora:64 "
                          f"(a rank from 1 to {MAX_LORA_RANK})")
    return kind, int(rank) if rank else 16


def _apply(build) -> None:
    kind, rank = lora_plan(build.recipe.lora)
    if kind == "qlora":
        quantize_base(build.model)  # once: a model already quantised (see ``trace``) is left as it is
    if kind in ("lora", "qlora"):
        build.model = apply_lora(build.model, rank=rank)


def _conflicts(r):
    if r.lora.startswith("qlora") and r.precision in ("fp32", "fp16-mixed"):
        yield f"lora={r.lora} and precision={r.precision} conflict: QLoRA computes in bf16; use bf16-mixed"


TECHNIQUE = Technique(
    name="lora",
    fields=(Field("lora", "off", "off | lora[:rank] | qlora[:rank] (changes the math)", slot=110, check=lora_plan),),
    order=15, apply=_apply, conflicts=_conflicts,
    search=lambda ctx: [{"lora": "off"}] + [{"lora": f"{k}:{SEARCH_RANK}"} for k in ("lora", "qlora") if k in ctx.allowed],
    approximations=lambda r: [f"lora={r.lora}"] if r.lora != "off" else [],
    allow=("lora", "qlora"), trace="both")
