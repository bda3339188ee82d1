"""A DeepSpeed config (``ds_config.json``, the ``deepspeed`` key of TrainingArguments, accelerate's DeepSpeed plugin)
in memfit's terms: ``parallel=zero1|zero2|zero3`` and ``zero=...`` (``techniques/zero_config.py``), the micro-batch,
accumulation and precision it sets.

The Hugging Face Trainer's ``"auto"`` values: the micro-batch, accumulation and precision are the Trainer's own
arguments (read from its file, not from here); ``reduce_bucket_size``, ``stage3_prefetch_bucket_size`` and
``stage3_param_persistence_threshold`` stay ``auto`` in ``zero=`` and are resolved as the Trainer resolves them when the
engine is made, from the model's hidden size (hidden², 0.9·hidden², 10·hidden; ``zero_config.resolve_auto``).
Settings that change no device byte of a step (logging, the scheduler, clipping, checkpoint I/O) are read as
neutral; DeepSpeed's own activation checkpointing, fp16 loss-scaling knobs aside, and anything not known are refused
in one line naming the key.

Why by hand: DeepSpeed's ``DeepSpeedConfig`` parses these files but needs a process group and its batch arithmetic
checked against a world size, and says nothing of memory; the mapping to memfit's fields is memfit's vocabulary (its
inverse is ``zero_config.ds_config``, validated by ``DeepSpeedConfig`` in the tests).
"""

from __future__ import annotations

from memfit.errors import MemfitError, shown
from memfit.techniques.zero_config import ZeroConfig

__all__ = ["read_ds_config", "looks_like_ds_config"]

# top-level keys that change no device byte of a training step
_NEUTRAL = {"steps_per_print", "wall_clock_breakdown", "gradient_clipping", "scheduler", "train_batch_size",
            "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "tensorboard", "wandb", "csv_monitor",
            "comet", "flops_profiler", "comms_logger", "dump_state", "prescale_gradients", "gradient_predivide_factor",
            "checkpoint", "memory_breakdown", "timers", "seed", "disable_allgather", "sparse_gradients"}
_OPTIMIZERS = {"adamw": "adamw", "adam": "adam", "sgd": "sgd"}  # DeepSpeed's optimizer types memfit models (torch's)


def looks_like_ds_config(data: dict) -> bool:
    return isinstance(data, dict) and ("zero_optimization" in data or "train_micro_batch_size_per_gpu" in data)


def read_ds_config(name: str, data: dict) -> tuple[dict, list]:
    """(Recipe fields, [(key, value, how it was read)]) of a DeepSpeed config ``data``; ``name`` for messages."""
    if not isinstance(data, dict):
        raise MemfitError(f"{name}: a DeepSpeed config is a mapping (ds_config.json), got {type(data).__name__}")
    fields: dict = {}
    read: list = []
    zero = data.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise MemfitError(f"{name}: zero_optimization must be a mapping, got {shown(zero, 40)}")
    stage = zero.get("stage", 0)
    if stage not in (1, 2, 3):
        raise MemfitError(f"{name}: zero_optimization.stage={shown(stage, 20)}: memfit models ZeRO stages 1, 2 and 3 "
                          "(stage 0 is plain data parallelism: --parallel ddp)")
    fields["parallel"] = f"zero{stage}"
    data_types = data.get("data_types") or {}
    try:
        fields["zero"] = ZeroConfig.from_ds(zero, data_types).text
    except MemfitError as err:
        raise MemfitError(f"{name}: {err}") from None
    read.append(("zero_optimization", zero, "read"))
    for key, value in data.items():
        if key in ("zero_optimization", "data_types"):
            continue
        if key == "train_micro_batch_size_per_gpu":
            if value != "auto":
                fields["micro_batch_size"] = _count(name, key, value)
        elif key == "gradient_accumulation_steps":
            if value != "auto":
                fields["grad_accum_steps"] = _count(name, key, value)
        elif key in ("bf16", "fp16", "bfloat16"):
            enabled = (value or {}).get("enabled", False) if isinstance(value, dict) else value
            dtype = "fp16" if key == "fp16" else "bf16"
            if enabled is True:
                fields["precision"] = dtype
            elif enabled == "auto":
                read.append((key, value, "auto: the Trainer's bf16 / fp16 argument"))
                continue
        elif key == "optimizer":
            kind = str((value or {}).get("type", "")).lower()
            if kind not in _OPTIMIZERS:
                raise MemfitError(f"{name}: optimizer type {shown(kind, 30)} is not modelled: memfit models AdamW, "
                                  "Adam and SGD (torch's); drop the optimizer section to use the Trainer's")
            fields["optimizer"] = _OPTIMIZERS[kind]
        elif key == "activation_checkpointing":
            raise MemfitError(f"{name}: DeepSpeed's own activation_checkpointing is not modelled: drop it and "
                              "checkpoint with the model's (gradient_checkpointing, or memfit's --checkpointing "
                              "blocks)")
        elif key == "communication_data_type":
            if value is not None:
                raise MemfitError(f"{name}: communication_data_type={shown(value, 20)} is not modelled: DeepSpeed "
                                  "reduces in the model's dtype by default; drop it")
        elif key not in _NEUTRAL:
            raise MemfitError(f"{name}: {shown(key, 40)} is not a DeepSpeed setting memfit knows (a typo, or one it "
                              "does not model: ZeRO++, MiCS, pipeline, compression...): remove it or fix its name")
        else:
            read.append((key, value, "no effect on device memory"))
            continue
        read.append((key, value, "read"))
    return fields, read


def _count(name: str, key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MemfitError(f"{name}: {key} must be a whole number from 1, or \"auto\", got {shown(value, 30)}")
    return value


def load_ds_config(name: str, value, base: str) -> dict:
    """A ``deepspeed`` setting's config: the mapping itself, or the JSON file it names (relative to ``base``, the
    folder of the file that names it, or to the working folder, as the Trainer opens it)."""
    import json
    import os

    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise MemfitError(f"{name}: deepspeed must be the path of a ds_config.json or its mapping, got "
                          f"{shown(value, 40)}")
    found = next((p for p in (value, os.path.join(base, value)) if os.path.isfile(p)), None)
    if found is None:
        raise MemfitError(f"{name}: deepspeed={shown(value, 60)}: no such file here or beside {name}")
    try:
        with open(found, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise MemfitError(f"{name}: cannot read the DeepSpeed config {shown(found, 60)}: {err}") from None


# accelerate's DeepSpeed plugin keys (``deepspeed_config:`` in its config YAML) that change no device byte here
_ACCELERATE_NEUTRAL = {"gradient_clipping", "zero3_init_flag", "zero3_save_16bit_model", "deepspeed_multinode_launcher",
                       "deepspeed_hostfile", "deepspeed_exclusion_filter", "deepspeed_inclusion_filter"}


def from_accelerate(name: str, plugin: dict, base: str) -> tuple[dict, list]:
    """Recipe fields of accelerate's ``deepspeed_config`` (its plugin's fields, or the file it names)."""
    if not isinstance(plugin, dict):
        raise MemfitError(f"{name}: deepspeed_config must be a mapping, got {shown(plugin, 40)}")
    if plugin.get("deepspeed_config_file"):
        return read_ds_config(name, load_ds_config(name, plugin["deepspeed_config_file"], base))
    zero: dict = {"stage": plugin.get("zero_stage", 2)}  # accelerate's default stage
    for key, target in (("offload_optimizer_device", "offload_optimizer"), ("offload_param_device", "offload_param")):
        if plugin.get(key) not in (None, "none"):
            zero[target] = {"device": plugin[key]}
    data = {"zero_optimization": zero}
    if plugin.get("gradient_accumulation_steps") not in (None, "auto"):
        data["gradient_accumulation_steps"] = plugin["gradient_accumulation_steps"]
    unknown = set(plugin) - {"zero_stage", "offload_optimizer_device", "offload_param_device",
                             "gradient_accumulation_steps", "deepspeed_config_file"} - _ACCELERATE_NEUTRAL
    if unknown:
        raise MemfitError(f"{name}: deepspeed_config.{sorted(unknown)[0]} is not an accelerate DeepSpeed setting "
                          "memfit knows: remove it or fix its name")
    return read_ds_config(name, data)


def merged(fields: dict, ds_fields: dict) -> dict:
    """The Trainer's (or accelerate's) fields with its DeepSpeed config's: DeepSpeed casts the model itself, so the
    Trainer's bf16 / fp16 autocast becomes DeepSpeed's bf16 / fp16 section; numbers the DeepSpeed file sets must agree
    with the Trainer's (the Trainer refuses a mismatch too)."""
    out = dict(fields)
    for key, value in ds_fields.items():
        if key in ("micro_batch_size", "grad_accum_steps") and key in fields and fields[key] != value:
            raise MemfitError(f"the DeepSpeed config's {key}={value} differs from the Trainer's {fields[key]}: set it "
                              "\"auto\" (the Trainer fills it) or make them equal")
        out[key] = value
    precision = out.get("precision", "fp32")
    if precision.endswith("-mixed"):
        out["precision"] = precision.split("-")[0]
    return out
