"""A checkpoint shipped quantised (``quantization_config`` in its config.json), read as what it is.

The formats and what each stores per weight, as transformers' quantisers lay them out:

- ``bitsandbytes`` 4-bit (NF4/FP4): 4 bits, an absmax per block of 64 (double-quantised: one byte, plus
  an fp32 per 256 blocks; else an fp32 each); 8-bit (LLM.int8): a byte, plus an fp32 scale per output row.
- ``gptq``: ``bits`` packed in int32, per group of ``group_size`` inputs an fp16 scale and a packed zero
  point, and an int32 ``g_idx`` per input. ``awq``: the same without ``g_idx``.
- ``fp8`` (fine-grained, DeepSeek-V3's): a byte, plus an fp32 inverse scale per ``weight_block_size`` block;
  ``fbgemm_fp8``: a byte plus an fp32 scale per output row.
- ``mxfp4`` (gpt-oss): only the experts' weights, 4 bits plus a shared 8-bit exponent per 32 values.

Layers quantised: every ``nn.Linear`` but the output head and ``modules_to_not_convert`` (``mxfp4``: the
experts' weights only); the rest in the checkpoint's dtype. What training such a checkpoint means is
the estimate's business (``estimator/estimate.py``): LoRA over the frozen 4-bit base (QLoRA), or the
weights dequantised. Written here because transformers quantises only while loading real weights.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

import torch

from memfit.errors import MemfitError

__all__ = ["Quantization", "quantization_of", "stored_bytes"]

_DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class Quantization:
    method: str  # quant_method as the config names it
    label: str  # e.g. "bitsandbytes nf4", "gptq int4 g128"
    bits: int  # bits of a quantised weight value
    group: int | None = None  # inputs per scale (gptq / awq), values per block (bnb), None: per row
    block: tuple[int, int] | None = None  # fp8 weight_block_size
    double_quant: bool = False
    skip: tuple[str, ...] = ()  # modules_to_not_convert
    four_bit_base: bool = False  # LoRA over it is QLoRA as memfit models it (a frozen 4-bit base)
    dtype_bytes: int = 2  # bytes per value of the weights it leaves unquantised (the checkpoint's dtype)

    def to_dict(self) -> dict:
        return {"method": self.method, "label": self.label, "bits": self.bits}


def quantization_of(config) -> Quantization | None:
    """The ``Quantization`` of a config's ``quantization_config``, None without one."""
    raw = getattr(config, "quantization_config", None)
    if raw is None:
        return None
    q = raw if isinstance(raw, dict) else raw.to_dict() if hasattr(raw, "to_dict") else vars(raw)
    method = str(q.get("quant_method", "")).lower()
    common = {"skip": tuple(q.get("modules_to_not_convert") or q.get("llm_int8_skip_modules") or ()),
              "dtype_bytes": _dtype_bytes(config)}
    if method == "bitsandbytes":
        if q.get("load_in_4bit") or q.get("_load_in_4bit"):
            kind = q.get("bnb_4bit_quant_type", "nf4")
            double = bool(q.get("bnb_4bit_use_double_quant"))
            return Quantization(method, f"bitsandbytes {kind}", 4, 64, double_quant=double, four_bit_base=True,
                                **common)
        return Quantization(method, "bitsandbytes int8", 8, **common)
    if method in ("gptq", "awq"):
        bits, group = int(q.get("bits", q.get("w_bit", 4))), int(q.get("group_size", q.get("q_group_size", 128)))
        shown = f"{method} int{bits}" + (f" g{group}" if group > 0 else "")
        return Quantization(method, shown, bits, group if group > 0 else None, four_bit_base=bits == 4, **common)
    if method == "fp8":
        block = q.get("weight_block_size")
        return Quantization(method, "fp8" + (f" {block[0]}x{block[1]} blocks" if block else ""), 8,
                            block=tuple(block) if block else None, **common)
    if method == "fbgemm_fp8":
        return Quantization(method, "fbgemm fp8", 8, **common)
    if method == "mxfp4":
        return Quantization(method, "mxfp4 (experts)", 4, 32, **common)
    raise MemfitError(f"quantization_config quant_method {method or '(none)'!r} is not one memfit reads "
                      "(bitsandbytes, gptq, awq, fp8, fbgemm_fp8, mxfp4): drop quantization_config from the "
                      "config.json to estimate the model unquantised")


def _skipped(name: str, skip: tuple[str, ...]) -> bool:
    """Whether module ``name`` is one of ``modules_to_not_convert`` (a name, a suffix, or a pattern with ``*``)."""
    return any(fnmatch.fnmatchcase(name, s) or fnmatch.fnmatchcase(name, s + ".*") if "*" in s
               else name == s or name.endswith("." + s) or s in name.split(".") for s in skip)


def _linear_bytes(q: Quantization, out_features: int, in_features: int) -> int:
    numel = out_features * in_features
    values = numel * q.bits // 8
    if q.method == "bitsandbytes" and q.bits == 4:
        blocks = math.ceil(numel / 64)
        return values + (blocks + 4 * math.ceil(blocks / 256) if q.double_quant else 4 * blocks)
    if q.method == "bitsandbytes":
        return values + 4 * out_features
    if q.method in ("gptq", "awq"):
        groups = math.ceil(in_features / q.group) if q.group else 1
        packed = groups * out_features * (2 + q.bits / 8)
        return values + math.ceil(packed) + (4 * in_features if q.method == "gptq" else 0)
    if q.method == "fp8" and q.block:
        return values + 4 * math.ceil(out_features / q.block[0]) * math.ceil(in_features / q.block[1])
    return values + 4 * out_features  # fbgemm fp8 and fp8 without blocks: a scale per row


def stored_bytes(model: torch.nn.Module, q: Quantization) -> int:
    """Bytes of ``model``'s weights as the checkpoint stores them (``model`` may be on meta)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    done: set[int] = set()
    total = 0
    for name, module in model.named_modules():
        if q.method == "mxfp4":
            if name.endswith("experts") and not _skipped(name, q.skip):
                for param in module.parameters(recurse=False):
                    if param.dim() == 3:
                        done.add(id(param))
                        total += param.numel() // 2 + math.ceil(param.numel() / 32)
            continue
        if isinstance(module, torch.nn.Linear) and module is not head and not _skipped(name, q.skip):
            done.add(id(module.weight))
            total += _linear_bytes(q, module.out_features, module.in_features)
    seen = set(done)
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel() * q.dtype_bytes
    return total


def _dtype_bytes(config) -> int:
    """Bytes per value of the unquantised weights: the checkpoint's dtype (bf16 when unnamed)."""
    dtype = getattr(config, "dtype", None)
    return _DTYPES.get(str(dtype).replace("torch.", ""), 2)
