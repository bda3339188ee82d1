"""QLoRA's 4-bit layers, on real and on fake tensors: bitsandbytes' ``Linear4bit`` built from a
``nn.Linear`` (NF4, double-quantised absmax, blocks of 64, bf16 compute), and the quantisation
statistics it holds. Which layers, and why, is ``lora.py``'s business.

On fake tensors bitsandbytes' ``Params4bit`` cannot wrap a FakeTensor (``_make_subclass``), so the
quantised weight stays a plain fake parameter carrying the same attributes; bitsandbytes' ops have
fake kernels, so the forward and backward run its real Python code.

Written by hand because bitsandbytes quantises on load (``from_pretrained``) or on ``.cuda()``,
neither of which runs on fake tensors.

torchao's NF4 (``quant_impl=torchao``, what torchtune's QLoRA runs): the ``nn.Linear`` keeps its class and
its weight becomes torchao's ``NF4Tensor`` (``to_nf4``: blocks of 64, int8 scalers double-quantised in
blocks of 256), as torchtune's ``FrozenNF4Linear`` / ``LoRALinear(quantize_base=True)`` hold it; ``F.linear``
on it is torchao's ``linear_nf4``, whose eager dequantisation (``get_original_weight``) runs on fake tensors
as it runs on real ones: two int64 index tensors of half the weight each, then bf16 halves, scaled, stacked.
The subclass quantises on fake tensors as is, and FSDP2 shards and gathers it through its own hooks.
"""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from memfit.errors import MemfitError
from memfit.scoped import patched

__all__ = ["bnb_module", "quantized_linear", "nf4_linear", "nf4_module", "QUANT_IMPLS", "NF4_GROUP",
           "quant_state_tensors", "quantize_pending", "pending_settings"]


def bnb_module():
    with unset_fake_temporarily():  # bitsandbytes caches tables as it imports and here: real tensors
        try:
            import bitsandbytes
            import bitsandbytes.functional as F
        except ImportError:
            raise MemfitError("qlora needs bitsandbytes: pip install 'memfit[bnb]'") from None
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


NF4_DQ = dict(quant_type="nf4", compress_statistics=True, blocksize=64)  # QLoRA's: NF4, double-quantised absmax
_SETTINGS = tuple(NF4_DQ)


QUANT_IMPLS = ("bnb", "torchao")  # ``quant_impl``: whose NF4 QLoRA's 4-bit layers are
NF4_GROUP = 64 * 256  # torchao's to_nf4: a layer's weights come in blocks of 64, their scalers in blocks of 256


def nf4_module():
    """torchao's NF4 module (``to_nf4``, ``NF4Tensor``), imported outside any fake mode."""
    with unset_fake_temporarily():
        try:
            from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
        except ImportError:
            try:  # torchao before 0.14
                from torchao.dtypes import nf4tensor as nf4_tensor
            except ImportError:
                raise MemfitError("quant_impl=torchao needs torchao: pip install 'memfit[ao]'") from None
    return nf4_tensor


def nf4_linear(linear: torch.nn.Linear, nf4=None, dtype=torch.bfloat16) -> torch.nn.Linear:
    """``linear`` with its weight (in ``dtype``: torchtune quantises bf16 weights) as torchao's ``NF4Tensor``,
    a frozen parameter, in place: torchtune's ``FrozenNF4Linear``."""
    nf4 = nf4 or nf4_module()
    fake = isinstance(linear.weight, FakeTensor)
    # torchao quantises a million weights at a time to bound the (weights x 16) distances it compares; fake tensors
    # hold no bytes, so one pass makes the same codes' shapes (a 405B model's 126 layers in seconds, not minutes)
    with torch.no_grad(), patched(nf4, "CHUNK_SIZE", 1 << 62) if fake else contextlib.nullcontext():
        weight = nf4.to_nf4(linear.weight.detach().to(dtype))
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(linear.bias.detach().to(dtype), requires_grad=False)
    return linear


def quantized_linear(linear: torch.nn.Linear, bnb, compute_dtype=torch.bfloat16, storage=torch.uint8) -> torch.nn.Module:
    """A bitsandbytes ``Linear4bit`` (NF4-DQ, ``compute_dtype`` compute: QLoRA's bf16 by default) holding
    ``linear``'s weight, quantised; its packed codes typed ``storage`` (transformers' ``bnb_4bit_quant_storage``:
    bf16 lets ZeRO-3 partition them as it does the model's other weights)."""
    with unset_fake_temporarily():
        layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                  device="meta", compute_dtype=compute_dtype, compress_statistics=True,
                                  quant_type="nf4", quant_storage=storage)
    _quantize_into(layer, linear.weight.detach(), dict(NF4_DQ, quant_storage=storage))
    if linear.bias is not None:  # Linear4bit casts its bias to the compute dtype on first use; do it now
        layer.bias = torch.nn.Parameter(linear.bias.detach().to(compute_dtype), requires_grad=False)
    layer.compute_type_is_set = True
    return layer


def _quantize_into(layer, weight: torch.Tensor, settings: dict) -> None:
    """Quantise ``weight`` as bitsandbytes' ``Params4bit._quantize`` does and make it ``layer``'s weight."""
    bnb = bnb_module()
    with torch.no_grad(), _fake_inputs_allowed(weight):
        packed, state = bnb.functional.quantize_4bit(weight, **settings)
    if isinstance(packed, FakeTensor):
        _fake_state(state, packed.fake_mode)
        param = torch.nn.Parameter(packed, requires_grad=False)  # a FakeTensor marked as a parameter
        for name, value in dict({"quant_storage": torch.uint8}, **settings, bnb_quantized=True, module=layer).items():
            setattr(param, name, value)
        param.quant_state = state
    else:
        param = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, bnb_quantized=True, module=layer,
                                  **settings)
    layer._parameters["weight"] = param
    layer.quant_state = state


def pending_settings(param) -> dict | None:
    """A bitsandbytes ``Params4bit`` not quantised yet: its settings (else None)."""
    if not all(hasattr(param, name) for name in _SETTINGS + ("bnb_quantized",)) or param.bnb_quantized:
        return None
    return {name: getattr(param, name) for name in _SETTINGS}


def quantize_pending(model: torch.nn.Module) -> int:
    """Quantise, in place, the bitsandbytes 4-bit layers ``model`` built itself and has not quantised yet
    (a model built with ``Linear4bit`` layers, as Lightning Fabric's ``BitsandbytesPrecision`` builds
    one: bitsandbytes quantises such a weight when it moves to the GPU). Each keeps its class, forward,
    quantisation settings and the weight's dtype (its quantisation state's, which its dequantisation
    returns). The number of layers quantised."""
    done = 0
    for module in model.modules():
        weight = module._parameters.get("weight")
        settings = pending_settings(weight) if weight is not None else None
        if settings is not None:
            _quantize_into(module, weight.detach(), settings)
            done += 1
    return done


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
