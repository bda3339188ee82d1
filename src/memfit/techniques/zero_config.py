"""DeepSpeed's configuration as memfit reads and writes it: ``ZeroConfig`` (the ``zero_optimization`` keys memfit
models, by DeepSpeed's own names), the stages of ``parallel`` and ``ds_config`` (the whole config that runs a recipe).

Kept apart from ``deepspeed.py`` (the engine on fake tensors) so that reading a ds_config.json or writing one needs no
DeepSpeed installed. Left out: the keys ``_UNMODELLED`` names (each refused in one line), NVMe offload (DeepSpeed's
swapper needs its async_io op, built against libaio, which these machines cannot install: no truth to hold it to), a
partial offload ``ratio``.
"""

from __future__ import annotations

import dataclasses

from memfit.errors import MemfitError, shown

__all__ = ["ZeroConfig", "STAGES", "VERSION", "zero_stage", "ds_config", "check_zero", "resolve_auto", "zero_conflict"]

#: parallel values that are DeepSpeed ZeRO stages
STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}
VERSION = "0.19.8"  # the version whose allocations were read and measured (pyproject's ``deepspeed`` extra)

# DeepSpeed's zero_optimization keys memfit models: name -> (kind, DeepSpeed 0.19.8's default; None: stage's own)
_KEYS = {
    "reduce_bucket_size": ("int", 500_000_000),
    "allgather_bucket_size": ("int", 500_000_000),
    "overlap_comm": ("bool", None),  # stage 3: true, else false (runtime/zero/config.py)
    "contiguous_gradients": ("bool", True),
    "reduce_scatter": ("bool", True),
    "allgather_partitions": ("bool", True),  # false: each partition broadcast after the step, not all-gathered
    # what a save does (stage 3's 16-bit weights gathered on rank 0): nothing in the step; common in HF's examples
    "stage3_gather_16bit_weights_on_model_save": ("bool", False),
    "use_multi_rank_bucket_allreduce": ("bool", True),
    "round_robin_gradients": ("bool", False),
    "stage3_prefetch_bucket_size": ("int", 50_000_000),
    "stage3_max_live_parameters": ("int", 1_000_000_000),
    "stage3_max_reuse_distance": ("int", 1_000_000_000),
    "stage3_param_persistence_threshold": ("int", 100_000),
    "sub_group_size": ("int", 1_000_000_000),
    "offload_optimizer": ("offload", "none"),
    "offload_param": ("offload", "none"),
    # each offload section's pin_memory (true in 0.19.8's offload_config.py): which host partitions are page-locked
    "offload_optimizer_pin_memory": ("bool", True),
    "offload_param_pin_memory": ("bool", True),
    "grad_accum_dtype": ("dtype", None),  # ds_config's data_types.grad_accum_dtype (None: the model's dtype)
}
# keys DeepSpeed has and memfit does not model: refused by name rather than run as if absent
_UNMODELLED = ("zero_quantized_weights", "zero_quantized_gradients", "zero_quantized_nontrainable_weights",
               "zero_hpz_partition_size", "mics_shard_size", "mics_hierarchical_params_gather", "zenflow",
               "super_offload", "memory_efficient_linear",
               "ignore_unused_parameters", "legacy_stage1", "elastic_checkpoint", "load_from_fp32_weights",
               "stage3_use_all_reduce_for_fetch_params", "parameter_alignment", "log_trace_cache_warnings")
_OFFLOAD = ("none", "cpu")
# the Hugging Face Trainer's "auto" values, from the model's hidden size h (transformers' integrations/deepspeed.py)
_AUTO = {"reduce_bucket_size": lambda h: h * h, "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
         "stage3_param_persistence_threshold": lambda h: 10 * h}
_DTYPES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16"}


def _number(key: str, text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or value != int(value) or value < 0:
        raise MemfitError(f"zero {key}={shown(text)} is not a whole number of elements (e.g. {key}=5e8)")
    return int(value)


def _flag(key: str, text: str) -> bool:
    if text.lower() in ("true", "1", "yes", "on"):
        return True
    if text.lower() in ("false", "0", "no", "off"):
        return False
    raise MemfitError(f"zero {key}={shown(text)}: use true or false")


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """DeepSpeed's ``zero_optimization`` settings memfit models, with DeepSpeed's own names; only what differs from
    DeepSpeed's defaults is kept (``settings``). ``parse("reduce_bucket_size=5e7,overlap_comm=true")``,
    ``from_ds(config_dict)``; ``text`` writes it back."""

    settings: tuple = ()  # ((key, value), ...) sorted, defaults left out

    @classmethod
    def parse(cls, text: str) -> "ZeroConfig":
        if not isinstance(text, str):
            raise MemfitError(f"zero must be text key=value,... of DeepSpeed's zero_optimization keys, got "
                              f"{type(text).__name__}")
        values = {}
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            if "=" not in part:
                raise MemfitError(f"zero {shown(part)}: write key=value (e.g. reduce_bucket_size=5e7), keys as "
                                  "DeepSpeed's zero_optimization names them")
            key, value = (s.strip() for s in part.split("=", 1))
            values[key] = value
        return cls.from_values(values)

    @classmethod
    def from_values(cls, values: dict) -> "ZeroConfig":
        out = {}
        for key, raw in values.items():
            if key in _UNMODELLED:
                raise MemfitError(f"zero {key}: memfit does not model this DeepSpeed setting yet; drop it to estimate "
                                  "without it")
            if key not in _KEYS:
                close = [k for k in _KEYS if k.split("_")[0] == key.split("_")[0]][:3]
                raise MemfitError(f"zero {shown(key)} is not a zero_optimization key memfit knows"
                                  + (f" (did you mean {', '.join(close)}?)" if close else "")
                                  + f"; it knows {', '.join(_KEYS)}")
            kind, default = _KEYS[key]
            text = str(raw).strip()
            if text == "auto" and key in _AUTO:
                value = "auto"  # the Trainer's: from the model's hidden size when the engine is made (resolve_auto)
            elif kind == "int":
                value = _number(key, text)
            elif kind == "bool":
                value = raw if isinstance(raw, bool) else _flag(key, text)
            elif kind == "offload":
                value = text.lower()
                if value == "nvme":
                    raise MemfitError(f"zero {key}=nvme: NVMe offload is not modelled yet (its swap buffers and "
                                      "async I/O); use cpu, or none")
                if value not in _OFFLOAD:
                    raise MemfitError(f"zero {key}={shown(text)}: use cpu or none")
            else:
                value = _DTYPES.get(text.lower())
                if value is None:
                    raise MemfitError(f"zero {key}={shown(text)}: use fp32, bf16 or fp16")
            if value != default:
                out[key] = value
        return cls(tuple(sorted(out.items())))

    @classmethod
    def from_ds(cls, zero: dict, data_types: dict | None = None) -> "ZeroConfig":
        """From a ds_config's ``zero_optimization`` section (and ``data_types``): ``stage`` is the caller's, offload
        sections read by their ``device`` and ``pin_memory`` (``<section>_pin_memory``; buffer counts change no byte)."""
        values = {}
        for key, value in zero.items():
            if key == "stage":
                continue
            if key in ("offload_optimizer", "offload_param") and isinstance(value, dict):
                ratio = value.get("ratio", 1)
                if ratio not in (1, 1.0, None):
                    raise MemfitError(f"zero_optimization.{key}.ratio={ratio}: a partial offload is not modelled "
                                      "yet; drop ratio (1: all)")
                if value.get("pin_memory") is not None:
                    values[f"{key}_pin_memory"] = value["pin_memory"]
                value = value.get("device", "none") or "none"
            values[key] = value
        if data_types and data_types.get("grad_accum_dtype") is not None:
            values["grad_accum_dtype"] = data_types["grad_accum_dtype"]
        return cls.from_values(values)

    def get(self, key: str):
        return dict(self.settings).get(key, _KEYS[key][1])

    @property
    def text(self) -> str:
        return ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.settings)

    def zero_optimization(self, stage: int) -> dict:
        """The ``zero_optimization`` section DeepSpeed is given."""
        section = {"stage": stage}
        for key, value in self.settings:
            if key == "grad_accum_dtype" or key.endswith("_pin_memory"):
                continue
            section[key] = {"device": value} if key.startswith("offload_") else value
        for key in ("offload_optimizer", "offload_param"):
            if f"{key}_pin_memory" in dict(self.settings):
                section.setdefault(key, {"device": "none"})["pin_memory"] = self.get(f"{key}_pin_memory")
        return section


def resolve_auto(zero: ZeroConfig, hidden: int | None) -> ZeroConfig:
    """``zero`` with its ``auto`` values as the Trainer resolves them from the model's hidden size."""
    auto = [key for key, value in zero.settings if value == "auto"]
    if not auto:
        return zero
    if not hidden:
        raise MemfitError(f"zero {auto[0]}=auto is the Hugging Face Trainer's hidden-size rule, and this model has no "
                          "hidden_size: give a number")
    return ZeroConfig.from_values({**dict(zero.settings), **{key: _AUTO[key](hidden) for key in auto}})


def zero_stage(recipe) -> int:
    """The ZeRO stage of ``recipe.parallel`` (0: not DeepSpeed)."""
    return STAGES.get(str(recipe.parallel), 0)


def check_zero(value) -> None:
    ZeroConfig.parse(value)


def ds_config(recipe, world_size: int, micro_batch_size: int = 1, hidden: int | None = None) -> dict:
    """The DeepSpeed config that runs ``recipe`` over ``world_size`` ranks; ``hidden``: the model's hidden size, for
    ``auto`` settings."""
    stage = zero_stage(recipe)
    if not stage:
        raise MemfitError(f"parallel={recipe.parallel} is not a DeepSpeed ZeRO stage: use zero1, zero2 or zero3")
    zero = resolve_auto(ZeroConfig.parse(recipe.zero), hidden)
    config = {"train_micro_batch_size_per_gpu": micro_batch_size,
              "gradient_accumulation_steps": recipe.grad_accum_steps,
              "train_batch_size": micro_batch_size * recipe.grad_accum_steps * world_size,
              "zero_optimization": zero.zero_optimization(stage),
              # the recipe's own optimizer, passed to deepspeed.initialize as a client optimizer (as the Trainer does)
              "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
              "steps_per_print": 2**31 - 1, "wall_clock_breakdown": False}
    if recipe.precision in ("bf16", "fp16"):
        config[recipe.precision] = {"enabled": True}
    if zero.get("grad_accum_dtype") is not None:
        config["data_types"] = {"grad_accum_dtype": zero.get("grad_accum_dtype")}
    return config


_NF4 = "DeepSpeed's engine views each parameter's bytes, which torchao's NF4Tensor refuses; use quant_impl=bnb"


def zero_conflict(recipe) -> str | None:
    """One line naming what a ZeRO recipe cannot have (None: nothing)."""
    stage = zero_stage(recipe)
    if not stage:
        return f"zero={recipe.zero} needs parallel=zero1, zero2 or zero3 (DeepSpeed ZeRO)" if recipe.zero else None
    zero = ZeroConfig.parse(recipe.zero)
    if str(recipe.precision).endswith("-mixed"):
        dtype = str(recipe.precision).split("-")[0]
        return (f"parallel={recipe.parallel} and precision={recipe.precision} conflict: DeepSpeed casts the model "
                f"itself (its {dtype} section: {dtype} weights, fp32 master partitions); set precision={dtype}")
    if zero.get("offload_param") != "none" and stage != 3:
        return "zero offload_param=cpu needs parallel=zero3 (DeepSpeed offloads parameters in stage 3 only)"
    for key in (k for k in ("offload_optimizer", "offload_param") if f"{k}_pin_memory" in dict(zero.settings)):
        if zero.get(key) == "none":
            return f"zero {key}_pin_memory needs {key}=cpu: it says whether that offload's host partitions are pinned"
    if str(recipe.lora).startswith("qlora") and recipe.quant_impl != "bnb":
        return f"parallel={recipe.parallel} and lora={recipe.lora} conflict: " + _NF4
    for name in ("tp", "pp", "ep", "cp"):
        if getattr(recipe, name) > 1:
            return (f"parallel={recipe.parallel} and {name}={getattr(recipe, name)} conflict: memfit runs DeepSpeed "
                    f"ZeRO as data parallelism alone; drop {name}")
    for name, bad in (("offload", recipe.offload != "none"), ("offload_optimizer", bool(recipe.offload_optimizer)),
                      ("optimizer_in_backward", bool(recipe.optimizer_in_backward)),
                      ("compile", bool(recipe.compile)), ("chunked_loss", bool(recipe.chunked_loss)),
                      ("safe_step", bool(recipe.safe_step)),
                      ("optimizer", any(k in str(recipe.optimizer) for k in ("8bit", "4bit", "paged", "fp8")))):
        if bad:
            hint = " (DeepSpeed's own: zero offload_optimizer=cpu)" if name.startswith("offload") else ""
            return (f"parallel={recipe.parallel} and {name}={getattr(recipe, name)} conflict: memfit has not checked "
                    f"that pair against a real DeepSpeed run; drop {name}{hint}")
    for name, default in (("reshard_after_forward", "true"), ("mixed_precision", "none"), ("construction", "meta"),
                          ("shard_over", "node"), ("shard_modules", "")):
        if str(getattr(recipe, name)) != default:
            return (f"{name}={getattr(recipe, name)} is FSDP2's; with parallel={recipe.parallel} drop it (zero= holds "
                    "DeepSpeed's settings)")
    return None
