"""The weights a generation runs on: a dtype, bitsandbytes' 8-bit and 4-bit linear layers, or torchao's int8.

``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_8bit=True))`` swaps every
``nn.Linear`` but the output head for a ``Linear8bitLt`` (LLM.int8: int8 rows and one fp32 scale per
row, activations quantised per row in each forward, columns past the outlier ``threshold`` of 6.0 in
fp16); ``load_in_4bit`` for a ``Linear4bit`` (here NF4 with double-quantised absmax in blocks of 64,
QLoRA's format, computing in the model's dtype). The same swap is made here, on a real model (the
truth) or a fake one (the estimate), so both run bitsandbytes' own forward.

On fake tensors bitsandbytes' parameter classes cannot wrap a fake tensor, so the quantised weight is
a plain fake parameter carrying the attributes bitsandbytes reads (the 4-bit case is QLoRA's,
``techniques/lora.py``). How many columns of an activation are outliers is data: the fake run assumes
none (an int8 forward of a trained model has a few per layer, kilobytes), ``Outliers`` answers the two
bitsandbytes ops whose fake kernels would otherwise ask for a data-dependent size.

torchao's formats that run on the CPU (torch 2.13, torchao 0.18): ``ao-int8wo``
(``quantize_(model, Int8WeightOnlyConfig())``) and ``ao-int8da8w`` (``Int8DynamicActivationInt8WeightConfig()``,
activations quantised per token in each forward). Both make each weight an ``Int8Tensor``: int8 rows, one
fp32 scale and one int8 zero point per row. ``quantize_`` runs as is on the fake model: the subclass wraps
fake inner tensors, and its bytes are those inner tensors' (``stored``), which the ledger and the truth count.

Left out: torchao's int4 weight-only formats (torchao 0.18 packs int4 for CUDA (tinygemm), mslk, XPU or NPU:
none runs on the CPU), GPTQ / AWQ kernels (they need a GPU).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.errors import MemfitError
from memfit.scoped import rng_hop_rules
from memfit.techniques.apply import inner_tensors as stored  # a weight subclass (``Int8Tensor``): its inner tensors
from memfit.techniques.lora import ALL_LINEAR, bnb_module, quant_state_tensors, quantize_base, quantized_layers

__all__ = ["DTYPES", "WEIGHTS", "TORCHAO", "quantize_weights", "stored", "probed_ops", "Outliers", "INT8_THRESHOLD"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
WEIGHTS = ("auto", "int8", "nf4", "ao-int8wo", "ao-int8da8w")
#: memfit name -> torchao.quantization config class: the weight-only and dynamic-activation int8 formats, the
#: torchao formats that run on the CPU (torchao 0.18's int4 packings need CUDA, XPU/NPU or mslk)
TORCHAO = {"ao-int8wo": "Int8WeightOnlyConfig", "ao-int8da8w": "Int8DynamicActivationInt8WeightConfig"}
#: ops a format's forward calls whose CPU kernels allocate below the dispatcher, replayed for their scratch
#: (``accounting/scratch.py``): ao-int8da8w's ``int8 weight.sum(dim=0, dtype=int32)`` (the zero-point correction
#: of torchao's u8s8 path, taken on CPUs with AVX512-VNNI and no AMX) copies the whole weight to int32 inside the
#: sum kernel (20 KiB at a tiny Llama's peak, 10 % of it, before it was replayed)
_PROBED = {"ao-int8da8w": frozenset({"sum"})}
INT8_THRESHOLD = 6.0  # BitsAndBytesConfig's llm_int8_threshold


def quantize_weights(model: torch.nn.Module, weights: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """Make ``model``'s linear layers (not the heads) ``weights`` in place; the tensors the quantised
    layers hold beside their parameters (scales, absmax, code tables), which the model keeps resident."""
    if weights == "auto":
        return []
    if weights in TORCHAO:
        return _torchao(model, weights)
    bnb = bnb_module()
    if weights == "nf4":
        quantize_base(model, ALL_LINEAR, ALL_LINEAR, compute_dtype=dtype)
        return quant_state_tensors(model)
    names = quantized_layers(model)
    if not names:
        raise MemfitError(f"weights=int8 found no nn.Linear layers to quantise in {type(model).__name__}")
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, _int8_linear(getattr(owner, child), bnb, dtype))
    return [module.weight.SCB for module in model.modules() if isinstance(module, bnb.nn.Linear8bitLt)]


def probed_ops(weights: str) -> frozenset[str]:
    """The op names (``Ledger.probe_ops``) ``weights``' forward adds to a generation's."""
    return _PROBED.get(weights, frozenset())


def _torchao(model: torch.nn.Module, weights: str) -> list[torch.Tensor]:
    """``quantize_(model, config)`` on ``model``'s linear layers but the heads: each weight becomes torchao's
    ``Int8Tensor`` (int8 rows, one fp32 scale and one int8 zero point per row), a parameter whose bytes are
    its inner tensors'; nothing beside the parameters."""
    try:
        import torchao.quantization as ao
    except ImportError:
        raise MemfitError(f"weights={weights} needs torchao: pip install 'memfit[ao]'") from None
    names = set(quantized_layers(model))
    if not names:
        raise MemfitError(f"weights={weights} found no nn.Linear layers to quantise in {type(model).__name__}")
    ao.quantize_(model, getattr(ao, TORCHAO[weights])(), filter_fn=lambda module, name: name in names)
    return []


def _int8_linear(linear: torch.nn.Linear, bnb, dtype) -> torch.nn.Module:
    """A ``Linear8bitLt`` holding ``linear``'s weight as int8 rows and fp32 row scales, as
    ``Int8Params`` quantises it when it reaches its device."""
    with unset_fake_temporarily():
        layer = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                    has_fp16_weights=False, threshold=INT8_THRESHOLD, device="meta")
    weight = linear.weight.detach()
    with torch.no_grad():
        rows, scales, _ = bnb.functional.int8_vectorwise_quant(weight.to(torch.float16))
    if isinstance(rows, FakeTensor):
        param = torch.nn.Parameter(rows, requires_grad=False)
        param.CB, param.SCB, param.has_fp16_weights = rows, scales, False
    else:
        param = bnb.nn.Int8Params(rows, requires_grad=False, has_fp16_weights=False, CB=rows, SCB=scales)
    layer._parameters["weight"] = param
    if linear.bias is not None:
        layer.bias = torch.nn.Parameter(linear.bias.detach().to(dtype), requires_grad=False)
    return layer


_VECTORWISE = "int8_vectorwise_quant"
_MIXED = "int8_mixed_scaled_mm"


class Outliers(TorchDispatchMode):
    """On fake tensors: LLM.int8's outlier columns are none (see the module), so the two bitsandbytes ops
    whose output size is the outlier count answer with zero of them instead of a data-dependent size."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if func.namespace == "bitsandbytes" and name in (_VECTORWISE, _MIXED) \
                and any(isinstance(t, FakeTensor) for t in args if isinstance(t, torch.Tensor)):
            if name == _VECTORWISE:
                a = args[0]
                rows = torch.empty(a.shape, device=a.device, dtype=torch.int8)
                stats = torch.empty(a.numel() // a.shape[-1], device=a.device, dtype=torch.float32)
                threshold = args[1] if len(args) > 1 else kwargs.get("threshold", 0.0)
                return rows, stats, (a.new_empty(0, dtype=torch.int64) if threshold else None)
            # bitsandbytes' kernel without outliers: the int8 product, and an empty tensor for them
            a, ca, cb, sca, scb = args[:5]
            bias = args[6] if len(args) > 6 else kwargs.get("bias")
            out = torch.ops.bitsandbytes.int8_scaled_mm.default(ca, cb, sca, scb, bias=bias, dtype=a.dtype)
            return out, torch.empty(0, device=a.device, dtype=a.dtype)
        return func(*args, **kwargs)


rng_hop_rules(Outliers)
