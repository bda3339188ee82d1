"""LoRA through peft: the base weights freeze, small low-rank adapters train.

Memory: gradients and optimizer state exist only for the adapters (a few MiB instead of 12 bytes
per base parameter with AdamW); activations are about the same (the frozen layers still save
their inputs for the adapters' backward). Cost: slightly more compute per linear layer; the model
learns a low-rank update only, so the result differs from full fine-tuning: ``Recipe.is_exact``
is False and the planner uses it only when allowed by name.

Which layers (``lora_targets``): ``all-linear`` (the default) is every ``nn.Linear`` (and GPT-2's
``Conv1D``) but the output head, as peft's ``target_modules="all-linear"``; or a comma-separated list
of module-name suffixes matched as peft matches them (a layer is chosen when its name is the entry or
ends with ``.`` + the entry): ``q_proj,v_proj`` is torchtune's ``lora_attn_modules: [q_proj, v_proj]``,
adding ``gate_proj,up_proj,down_proj`` its ``apply_lora_to_mlp``, ``lm_head`` its
``apply_lora_to_output``; ``all-linear,lm_head`` adds the head to the default. Every entry must name a
linear layer of the model (checked when applied, one line listing the model's linear layer names).
Rank ``r`` from ``lora``; ``lora_alpha`` (None: ``2r``, as before) sets peft's scaling ``alpha / r``
and changes no memory.

Adapter dtype (``lora_dtype``): ``fp32`` (the default) is peft's ``autocast_adapter_dtype=True``,
which keeps adapters in fp32 on a bf16 base; ``bf16`` keeps them in the base's bf16, as torchtune does
(its LoRA recipe builds the model under ``set_default_dtype(bf16)`` and checks the adapters are bf16),
and is allowed with ``precision=bf16`` only: the adapters' weights, gradients and AdamW moments halve,
and peft no longer makes an fp32 copy of each adapted layer's input for ``lora_A``. Measured with
``bench/published/published.py`` on torchtune's Llama-3.2-3B rows: LoRA +8.9 % -> +2.4 %, QLoRA +16.7 % -> +4.8 %
(``tests/test_lora_targets.py`` checks it against the CPU allocator). 4-bit bases never hand their
dtype to peft, so the adapters are cast after wrapping.

Heads: the output head (``get_output_embeddings()``) is left frozen unless named. A task head of a
Hugging Face classification model (``classifier``, ``score``, ``qa_outputs``: new, untrained weights)
is trained in full through peft's ``modules_to_save``, as peft's ``task_type="SEQ_CLS"`` /
``"TOKEN_CLS"`` / ``"QUESTION_ANS"`` and its image-classification guide do: peft keeps the original
and a trainable copy, so the head's weights count twice, plus its gradients and optimizer state.
Outside Hugging Face models the last ``nn.Linear`` is taken as the head and stays frozen.

Dropout (``lora_dropout``, peft's ``lora_dropout``, default 0.0): peft applies it to each adapted
layer's input before ``lora_A`` (``lora_B(lora_A(dropout(x)))``), so every adapted layer keeps, for
backward, a dropped copy of its input (what ``lora_A`` saves) and the dropout's mask: on CPU a mask in
the input's dtype, on CUDA the fused kernel's bool mask (``hardware/cuda.py``); layers that share an
input (q, k, v) each draw their own. The undropped input is then saved by nobody (a frozen base layer
needs no input for backward: it computes no weight gradient), so it is freed unless another op keeps
it. At 0.0 peft uses ``nn.Identity`` and ``lora_A`` saves the very tensor the base layer computed
from. Measured on the zoo's GPT (2 blocks, d 128, 4 x 64 tokens, fp32): p=0.1 adds 3.50 MiB of
masks and copies and frees 1.62 MiB of layer-norm and GELU outputs, +1.87 MiB net at the peak. None
of this is a formula here: the step runs peft's own forward on fake tensors, and
``tests/test_lora_targets.py`` checks it against the CPU allocator.

On fake tensors peft's move of each new adapter to its base layer's device would swap a fake
parameter in place, which torch refuses; the adapters are built where the base already is, so the
move is skipped while wrapping.

QLoRA (``quantize_base`` then ``apply_lora``): linear layers first become bitsandbytes
``Linear4bit`` (NF4, double-quantised absmax, blocks of 64, bf16 compute): 0.5 byte per weight plus
about 0.02 for the quantisation state, instead of 2 or 4. Which ones (``quantize_targets``):
``all-linear`` (the default) is every ``nn.Linear`` but the heads, whether adapted or not, as the
QLoRA paper and transformers' ``BitsAndBytesConfig(load_in_4bit=True)`` do (its skip list,
``llm_int8_skip_modules``, defaults to the output head); ``adapted`` is only the layers LoRA adapts,
as torchtune's ``quantize_base=True`` does (its frozen layers without adapters stay in 16/32 bits);
a comma-separated list of suffixes names them (heads cannot be quantised: they are trained or tied).
The base weight is dequantised inside the matmul kernel (forward) and once per layer in backward, so
activations are about those of LoRA. The quantisation happens before the first step (as loading a
quantised checkpoint would), not inside it. Left out on purpose: peft's
``prepare_model_for_kbit_training`` (it casts every other weight to fp32 and turns on checkpointing
by itself; here precision and checkpointing are the recipe's own fields). Layers that are not
``nn.Linear`` (GPT-2's ``Conv1D``) stay unquantised; a model with no adaptable ``nn.Linear`` at all
(GPT-2) is refused, since QLoRA would quantise nothing. The 4-bit layers themselves, on fake tensors
too, are built in ``_qlora.py``.

A model may also build bitsandbytes ``Linear4bit`` layers itself and bring its own adapters (Lightning
Fabric's ``BitsandbytesPrecision`` builds every ``nn.Linear`` so, the head included; LitGPT's LoRA is its
own): such layers are quantised before the step whatever ``lora`` says (``quantize_pending``), each with
its own settings, class and forward, as bitsandbytes quantises them on the way to the GPU.
"""

from __future__ import annotations

import contextlib
import re

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from memfit.errors import MemfitError, shown
from memfit.scoped import patched
from memfit.techniques._qlora import (NF4_GROUP, QUANT_IMPLS, bnb_module, nf4_linear, nf4_module, pending_settings,
                                      quant_state_tensors, quantize_pending, quantized_linear)
from memfit.techniques.spec import Field, Technique

__all__ = ["apply_lora", "quantize_base", "prepare_lora", "quant_state_tensors", "lora_plan", "lora_layers",
           "quantized_layers", "task_heads", "quantize_pending", "pending_settings", "TECHNIQUE"]


@contextlib.contextmanager
def _no_moves(model):
    if not any(isinstance(p, FakeTensor) for p in model.parameters()):
        yield
        return
    with patched(torch.nn.Module, "to", lambda self, *args, **kwargs: self), \
            patched(FakeTensor, "__deepcopy__", _fake_deepcopy):
        yield


def _fake_deepcopy(self, memo):
    """A fake tensor's deep copy in its own fake mode (torch's copies the storage into a new mode, which
    the step then refuses to mix): peft copies a head it trains in full (``modules_to_save``)."""
    if id(self) not in memo:
        with torch.no_grad():
            copied = self.detach().clone()
        if getattr(self, "_is_param", False):
            copied = torch.nn.Parameter(copied, requires_grad=self.requires_grad)
        memo[id(self)] = copied.requires_grad_(self.requires_grad)
    return memo[id(self)]


def _is_hf(model) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, PreTrainedModel)


TASK_HEADS = ("classifier", "score", "qa_outputs")  # peft's SEQ_CLS_HEAD_NAMES and QUESTION_ANS head
ALL_LINEAR = "all-linear"
_ENTRY = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")


def _adaptable(module) -> bool:
    """What peft puts LoRA on here: ``nn.Linear``, and transformers' ``Conv1D`` (GPT-2)."""
    if isinstance(module, torch.nn.Linear):
        return True
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover
        return False
    return isinstance(module, Conv1D)


def task_heads(model) -> list[str]:
    """A Hugging Face classification model's task head(s): new weights that train in full."""
    if not _is_hf(model) or model.get_output_embeddings() is not None:
        return []
    return [name for name in TASK_HEADS if isinstance(getattr(model, name, None), torch.nn.Module)]


def _heads(model, names: list[str]) -> list[str]:
    """The heads among ``names``: the output head, a task head, or (not HF) the last linear layer."""
    if _is_hf(model):
        out = model.get_output_embeddings()
        roots = [n for n, m in model.named_modules() if out is not None and m is out] + task_heads(model)
        return [n for n in names if any(n == r or n.startswith(r + ".") for r in roots)]
    return names[-1:] if len(names) > 1 else []


def _linear_names(model) -> list[str]:
    """Every ``nn.Linear`` but the heads: the layers QLoRA quantises by default."""
    names = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    heads = set(_heads(model, [n for n, m in model.named_modules() if _adaptable(m)]))
    return [n for n in names if n not in heads]


def _entries(value: str) -> list[str]:
    return [e.strip() for e in value.split(",")]


def check_targets(value, name: str = "lora_targets", extra: tuple = ()) -> None:
    """``all-linear`` or comma-separated module-name suffixes (checked against a model when applied)."""
    words = (ALL_LINEAR,) + extra
    if not isinstance(value, str) or not value.strip() or not all(
            e in words or _ENTRY.fullmatch(e) for e in _entries(value)):
        raise MemfitError(f"{name} {shown(value)} not understood: use {' or '.join(words)}, or module-name "
                          "suffixes separated by commas such as q_proj,v_proj")


def _matching(names: list[str], entry: str) -> list[str]:
    return [n for n in names if n == entry or n.endswith("." + entry)]


def _resolve(model, value: str, field: str, candidates: list[str], default: list[str], words: dict) -> list[str]:
    """The layers of ``candidates`` that ``value`` names, in the model's order; one line if an entry
    names none."""
    chosen = set()
    for entry in _entries(value):
        if entry == ALL_LINEAR:
            chosen.update(default)
        elif entry in words:
            chosen.update(words[entry])
        else:
            found = _matching(candidates, entry)
            if not found:
                leaves = list(dict.fromkeys(n.rpartition(".")[2] for n in candidates))
                raise MemfitError(f"{field} entry {shown(entry)} names no {'quantisable ' if words else ''}linear "
                                  f"layer of {type(model).__name__}: its layers are {', '.join(leaves) or 'none'}")
            chosen.update(found)
    return [n for n in candidates if n in chosen]


def lora_layers(model, targets: str = ALL_LINEAR) -> list[str]:
    """The names of the layers ``lora_targets`` adapts in ``model`` (see the module docstring)."""
    names = [name for name, module in model.named_modules() if _adaptable(module)]
    heads = set(_heads(model, names))
    return _resolve(model, targets, "lora_targets", names, [n for n in names if n not in heads], {})


def quantized_layers(model, targets: str = ALL_LINEAR, lora_targets: str = ALL_LINEAR) -> list[str]:
    """The names of the ``nn.Linear`` layers ``quantize_targets`` makes 4-bit (never a head)."""
    names = _linear_names(model)
    adapted = [n for n in lora_layers(model, lora_targets) if n in names] if "adapted" in _entries(targets) else []
    return _resolve(model, targets, "quantize_targets", names, names, {"adapted": adapted})


def _peft():
    try:
        import peft
    except ImportError:
        raise MemfitError("lora needs peft: pip install 'memfit[peft]'") from None
    return peft


def apply_lora(model: torch.nn.Module, *, rank: int, targets: str = ALL_LINEAR, alpha: int | None = None,
               dropout: float = 0.0, dtype: str = "fp32") -> torch.nn.Module:
    """``model`` wrapped by peft with LoRA adapters of rank ``rank`` on ``targets`` (see the module
    docstring); the base is frozen, a classification model's task head trains in full; the adapters'
    weights in ``dtype`` (``lora_dtype``)."""
    peft = _peft()
    layers = lora_layers(model, targets)
    if not layers:
        raise MemfitError(f"lora found no linear layer to adapt in {type(model).__name__}: pass a model with "
                          "nn.Linear layers, or leave lora off")
    # a task head trains in full unless the targets put adapters in it
    save = [h for h in task_heads(model) if not any(n == h or n.startswith(h + ".") for n in layers)]
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank if alpha is None else alpha, lora_dropout=float(dropout),
                             target_modules=layers, modules_to_save=save or None)
    with _no_moves(model):
        model = peft.get_peft_model(model, config, autocast_adapter_dtype=dtype == "fp32")
    if dtype != "fp32":
        _cast_adapters(model, peft, ADAPTER_DTYPES[dtype])
    return model


def _cast_adapters(model, peft, dtype) -> None:
    """Each adapter weight as a new parameter of ``dtype``: peft gives adapters a 16-bit base's dtype
    only in the move to the base's device, which 4-bit bases (and fake ones, ``_no_moves``) skip, and
    ``module.to`` cannot swap a fake parameter in place."""
    for layer in model.modules():
        if isinstance(layer, peft.tuners.lora.LoraLayer):
            for adapter in (*layer.lora_A.values(), *layer.lora_B.values()):
                for name, weight in list(adapter.named_parameters(recurse=False)):
                    setattr(adapter, name, torch.nn.Parameter(weight.detach().to(dtype), requires_grad=weight.requires_grad))


def quantize_base(model: torch.nn.Module, targets: str = ALL_LINEAR, lora_targets: str = ALL_LINEAR,
                  compute_dtype=torch.bfloat16, impl: str = "bnb", storage=torch.uint8) -> torch.nn.Module:
    """Replace the ``nn.Linear`` layers ``targets`` names (``quantize_targets``; ``adapted`` reads
    ``lora_targets``) by 4-bit ones computing in ``compute_dtype``, in place (once): bitsandbytes'
    ``Linear4bit`` (``impl="bnb"``) or the same layer holding torchao's ``NF4Tensor`` (``"torchao"``).

    Already-quantised models (a bitsandbytes ``Linear4bit`` or an ``NF4Tensor`` anywhere) are left as they are.
    """
    lib = bnb_module() if impl == "bnb" else nf4_module()
    done = any(isinstance(m, lib.nn.Linear4bit) for m in model.modules()) if impl == "bnb" else \
        any(isinstance(p, lib.NF4Tensor) for p in model.parameters())
    if done:
        return model
    if not _linear_names(model):
        raise MemfitError(f"qlora found no nn.Linear layers to quantise in {type(model).__name__} (layers such as "
                          "GPT-2's Conv1D are not nn.Linear): use lora instead")
    names = quantized_layers(model, targets, lora_targets)
    if not names:
        raise MemfitError(f"quantize_targets={targets} with lora_targets={lora_targets} quantises no layer of "
                          f"{type(model).__name__}: adapt nn.Linear layers, or use lora instead of qlora")
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        layer = getattr(owner, child)
        if impl == "bnb":
            setattr(owner, child, quantized_linear(layer, lib, compute_dtype, storage))
        elif layer.weight.numel() % NF4_GROUP:
            raise MemfitError(f"quant_impl=torchao cannot quantise {name}: torchao's NF4 takes {NF4_GROUP}-weight groups "
                              f"(blocks of 64, scalers in blocks of 256) and it has {layer.weight.numel()}; leave it out "
                              "with quantize_targets, or use quant_impl=bnb")
        else:
            nf4_linear(layer, lib, compute_dtype)
    return model


def prepare_lora(model: torch.nn.Module, recipe) -> list[torch.Tensor]:
    """Before any step (and before any ledger watches): import peft, and quantise ``model`` as
    ``recipe`` asks for QLoRA (a quantised checkpoint loads so), and the 4-bit layers the model built
    itself (``quantize_pending``: Lightning Fabric's ``BitsandbytesPrecision`` builds every
    ``nn.Linear`` as one, quantised as it reaches the GPU); the quantisation statistics it then holds.

    peft and bitsandbytes build small tensors when first imported (bitsandbytes' 4-bit code tables);
    imported inside a fake step they would be fake, and counted as that step's memory (144 bytes on
    the first estimate of a process), so they are imported here, outside any fake mode.
    """
    kind, _ = lora_plan(recipe.lora)
    quantize_pending(model)
    if kind != "off":
        with unset_fake_temporarily():
            _peft()
    if kind == "qlora":
        quantize_base(model, recipe.quantize_targets, recipe.lora_targets, impl=recipe.quant_impl,
                      storage=_storage(recipe))
    return quant_state_tensors(model)


def _storage(recipe):
    """The dtype bitsandbytes packs 4-bit codes in: uint8, or under ZeRO-3, which partitions every weight, bf16
    (transformers' ``bnb_4bit_quant_storage``, as its DeepSpeed QLoRA guide sets it; the same bytes)."""
    return torch.bfloat16 if recipe.parallel == "zero3" else torch.uint8


MAX_LORA_RANK = 65536
MAX_LORA_ALPHA = 1 << 20
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
    r = build.recipe
    kind, rank = lora_plan(r.lora)
    if kind == "qlora":  # once: a model already quantised (see ``trace``) is left as it is
        quantize_base(build.model, r.quantize_targets, r.lora_targets, impl=r.quant_impl, storage=_storage(r))
    if kind in ("lora", "qlora"):
        build.model = apply_lora(build.model, rank=rank, targets=r.lora_targets, alpha=r.lora_alpha,
                                 dropout=r.lora_dropout, dtype=r.lora_dtype)


_DEFAULTS = {"lora_targets": ALL_LINEAR, "lora_alpha": None, "lora_dropout": 0.0, "quantize_targets": ALL_LINEAR,
             "lora_dtype": "fp32", "quant_impl": "bnb"}
#: ``lora_dtype`` -> the adapters' weight dtype
ADAPTER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _conflicts(r):
    if r.lora.startswith("qlora") and r.precision in ("fp32", "fp16-mixed"):
        yield f"lora={r.lora} and precision={r.precision} conflict: QLoRA computes in bf16; use bf16-mixed"
    for name, default in _DEFAULTS.items():
        value = getattr(r, name)
        if value != default and r.lora == "off":
            quantises = name in ("quantize_targets", "quant_impl")
            yield (f"{name}={value} and lora=off conflict: it shapes "
                   + ("QLoRA's 4-bit layers; set lora=qlora" if quantises else "the adapters; set lora=lora or lora=qlora"))
    if r.lora_dtype == "bf16" and r.lora != "off" and r.precision != "bf16":
        yield (f"lora_dtype=bf16 and precision={r.precision} conflict: bf16 adapters belong to pure bf16 "
               "weights; use precision=bf16 or lora_dtype=fp32")
    for name in ("quantize_targets", "quant_impl"):
        if getattr(r, name) != _DEFAULTS[name] and r.lora.startswith("lora"):
            yield f"{name}={getattr(r, name)} and lora={r.lora} conflict: only qlora quantises; use qlora"


def _check_alpha(value) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_LORA_ALPHA):
        raise MemfitError(f"lora_alpha must be an integer from 1 to {MAX_LORA_ALPHA} (or unset: 2 x rank), "
                          f"got {shown(value)}")


def _check_dropout(value) -> None:
    if not 0.0 <= value < 1.0:
        raise MemfitError(f"lora_dropout must be from 0 up to (not including) 1, got {shown(value)}: "
                          "peft's examples use 0.05 or 0.1")


TECHNIQUE = Technique(
    name="lora",
    fields=(Field("lora", "off", "off | lora[:rank] | qlora[:rank] (changes the math)", slot=110, check=lora_plan),
            Field("lora_targets", ALL_LINEAR, "layers LoRA adapts: all-linear (all but the output head) or "
                  "name suffixes such as q_proj,v_proj (add lm_head for the head)", slot=111, check=check_targets),
            Field("lora_alpha", None, "LoRA alpha: adapters scale by alpha / rank (default 2 x rank; no memory effect)", slot=112,
                  kind="optional-count", check=_check_alpha),
            Field("lora_dropout", 0.0, "dropout on each adapter's input (peft): a saved mask and input copy per "
                  "adapted layer", slot=113, kind="float", check=_check_dropout),
            Field("quantize_targets", ALL_LINEAR, "layers QLoRA makes 4-bit: all-linear (all but the heads), "
                  "adapted (only LoRA's layers, as torchtune) or name suffixes", slot=114,
                  check=lambda v: check_targets(v, "quantize_targets", ("adapted",))),
            Field("lora_dtype", "fp32", "adapter weights' dtype: fp32 (peft's default) or bf16 (torchtune's; "
                  "with precision=bf16): halves the adapters, their gradients and optimizer state", slot=115,
                  choices=tuple(ADAPTER_DTYPES)),
            Field("quant_impl", "bnb", "whose NF4 QLoRA runs: bnb (bitsandbytes' Linear4bit) or torchao (NF4Tensor, "
                  "torchtune's; eager dequantisation holds int64 indices)", slot=116, choices=QUANT_IMPLS)),
    order=15, apply=_apply, conflicts=_conflicts,
    search=lambda ctx: [{"lora": "off"}] + [{"lora": f"{k}:{SEARCH_RANK}"} for k in ("lora", "qlora") if k in ctx.allowed],
    approximations=lambda r: ([f"lora={r.lora}"] + (["lora_dtype=bf16"] if r.lora_dtype == "bf16" else []))
    if r.lora != "off" else [],
    allow=("lora", "qlora"), trace="both")
