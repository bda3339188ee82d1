"""A training run as the user's own trainer config says it, in memfit's terms (issue 36, item 1).

``read_trainer_config(path)`` reads a Hugging Face ``TrainingArguments`` file (JSON or YAML, the shape
``HfArgumentParser.parse_json_file`` / ``parse_yaml_file`` take; TRL's ``SFTConfig`` extends it, and TRL's
scripts read the ``ModelConfig`` fields of the same file: ``model_name_or_path``, ``use_peft``, ``lora_r``,
``load_in_4bit``...) into a ``TrainerConfig``: the ``Recipe``, the sequence length and the model where the file
names them. Every setting is one of three kinds:

- mapped: per-device batch, accumulation, bf16/fp16 autocast, ``optim`` (transformers' names, through
  ``techniques.optimizer.HF_OPTIM``), gradient (activation) checkpointing (non-reentrant: the Trainer's default),
  torch.compile, ``fsdp`` / ``fsdp_config`` (FSDP2, as transformers hands them to accelerate: bf16/fp16 then set
  FSDP2's MixedPrecisionPolicy as well as autocast), TRL's ``max_length``, ``activation_offloading`` and its
  LoRA / QLoRA fields;
- not modelled yet, refused in one line naming the setting and the fix when set away from its default
  (``_REFUSED``: reentrant checkpointing, Liger kernels, packing...); ``deepspeed`` (a ds_config path or mapping)
  is read by ``deepspeed_config.py`` and merged (DeepSpeed's bf16 / fp16 in place of autocast);
- without effect on a training step's device memory (logging, saving, evaluation, the schedule, the data loader's
  workers): every other field transformers' ``TrainingArguments`` (or TRL's known fields) has.
A key none of these know is refused too (a typo, or another trainer's file): nothing is dropped silently.

An accelerate config YAML (``accelerate config`` writes it; ``distributed_type`` tells it apart) gives the processes
(``num_processes`` over ``num_machines``), the autocast dtype (``mixed_precision``: accelerate wraps the model's
forward in autocast and, with FSDP2, sets the same dtype as FSDP2's MixedPrecisionPolicy) and FSDP2's settings
(``fsdp_version: 2``, ``fsdp_reshard_after_forward``, ``fsdp_offload_params``, ``fsdp_activation_checkpointing``);
the batch is the training script's, given with memfit's flags. DeepSpeed (``distributed_type: DEEPSPEED``: its
plugin's stage and offloads, or the ds_config it names) is read by ``deepspeed_config.py``; FSDP1, fp8 and the other
plugins are refused in one line. A ds_config.json on its own is read too (``kind`` "deepspeed").

Why by hand: transformers parses these files into ``TrainingArguments``, but building one checks the machine it runs
on (bf16 on a CPU is refused) and says nothing about memory; the mapping to memfit's fields is memfit's vocabulary
(its inverse, ``training/hf.py``, writes ``TrainingArguments`` from a recipe).
"""

from __future__ import annotations

import dataclasses
import os

from memfit.errors import MemfitError, shown
from memfit.techniques.recipe import Recipe
from memfit.trainers.config import _NEUTRAL_NOTE, MAX_FILE_BYTES, TrainerConfig, _count
from memfit.trainers.deepspeed_config import (from_accelerate, load_ds_config, looks_like_ds_config, merged,
                                              read_ds_config)

__all__ = ["TrainerConfig", "read_trainer_config"]

# settings that change a step's memory and are not modelled from this file yet: (default, the fix)
_REFUSED = {
    "parallelism_config": (None, "transformers' parallelism_config (TP / CP in the Trainer) is not read yet: pass "
                                 "--tp / --cp to memfit"),
    "use_liger_kernel": (False, "Liger's fused kernels are not modelled: memfit traces transformers' own layers "
                                "(--chunked-loss N models a chunked cross-entropy)"),
    "liger_kernel_config": (None, "Liger's fused kernels are not modelled"),
    "optim_target_modules": (None, "GaLore / APOLLO-style optimizers are not modelled"),
    "optim_args": (None, "optimizer arguments are not read: memfit models each optim name at its defaults"),
    "torch_compile_backend": (None, "only torch.compile's default backend (inductor) is modelled"),
    "torch_compile_mode": (None, "only torch.compile's default mode is modelled"),
    "torch_empty_cache_steps": (None, "memfit's caching-allocator model makes no empty_cache calls"),
    "auto_find_batch_size": (False, "memfit estimates the batch you give: `memfit estimate --max-batch-size` finds "
                                    "the largest that fits"),
    "label_smoothing_factor": (0.0, "the Trainer's label smoother (its own log-softmax over the logits) is not "
                                    "modelled"),
    "ddp_bucket_cap_mb": (None, "memfit models DDP's default 25 MiB buckets"),
    "use_cpu": (False, "estimate a CPU run with --device cpu"),
    "packing": (False, "TRL's packing is not read: pass the documents' lengths with --lengths FILE --packed"),
    "padding_free": (False, "TRL's padding-free batches are not read: pass the documents' lengths with --lengths "
                            "FILE --packed"),
    "load_in_8bit": (False, "8-bit base weights are not modelled: load_in_4bit (QLoRA) is"),
    "use_dora": (False, "DoRA adapters are not modelled: LoRA and QLoRA are"),
    "lora_modules_to_save": (None, "LoRA's modules_to_save (trained copies of whole layers) are not read"),
    "use_bnb_nested_quant": (False, "nested (double) quantization is not read: memfit's QLoRA is nf4 without it"),
    "bnb_4bit_quant_type": ("nf4", "memfit's QLoRA is nf4"),
    "torch_dtype": (None, "the base weights' dtype is read from the model's config: drop torch_dtype, or pass "
                          "--precision bf16 for pure bf16 weights"),
    "dtype": (None, "the base weights' dtype is read from the model's config: drop dtype, or pass --precision bf16 "
                    "for pure bf16 weights"),
    "attn_implementation": (None, "pass the attention with --attention sdpa|eager"),
}

# TRL's fields (SFTConfig beyond TrainingArguments, and the ModelConfig its scripts read from the same file) that do
# not change a training step's device memory
_TRL_NEUTRAL = {
    "dataset_text_field", "dataset_kwargs", "dataset_num_proc", "eos_token", "pad_token", "completion_only_loss",
    "assistant_only_loss", "chat_template_path", "model_init_kwargs", "dataset_name", "dataset_config",
    "dataset_train_split", "dataset_test_split", "dataset_streaming", "model_revision", "trust_remote_code",
    "use_fast_tokenizer", "pad_to_multiple_of", "shuffle_dataset", "eval_packing", "packing_strategy", "loss_type",
    "lora_task_type", "bnb_4bit_compute_dtype", "bnb_4bit_quant_storage", "max_prompt_length",
}
# fields only TRL's SFTConfig / ModelConfig have: a file with any of them is read as TRL's
_TRL_ONLY = {"max_length", "max_seq_length", "packing", "padding_free", "activation_offloading", "use_peft",
             "model_name_or_path", "load_in_4bit", "lora_r", "dataset_text_field", "completion_only_loss",
             "assistant_only_loss"}
# what ``read`` says of every other known field: TrainingArguments' fields beyond the mapped and refused ones (logging,
# saving, evaluation, the schedule, the data loader) leave a training step's device memory as it is


def _training_argument_fields() -> set:
    from transformers import TrainingArguments

    return {f.name for f in dataclasses.fields(TrainingArguments)}


def _load(path) -> dict:
    import yaml

    name = shown(str(path))
    if not isinstance(path, (str, bytes)) and not hasattr(path, "__fspath__"):
        raise MemfitError(f"cannot read trainer config {name}: pass the path of a .json or .yaml file")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as err:
        raise MemfitError(f"cannot read trainer config {name}: {err.strerror or err}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise MemfitError(f"trainer config {name} is over {MAX_FILE_BYTES // 1024} KiB: point --from at the "
                          "TrainingArguments file")
    try:
        data = yaml.safe_load(raw.decode("utf-8-sig"))  # as HfArgumentParser.parse_yaml_file reads it (JSON is YAML)
    except (UnicodeDecodeError, yaml.YAMLError) as err:
        problem = getattr(err, "problem", None) or "not UTF-8 text"
        raise MemfitError(f"trainer config {name} is not valid YAML/JSON ({problem}): fix the file") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise MemfitError(f"trainer config {name} must be a mapping of setting: value (TrainingArguments' fields), "
                          f"got {type(data).__name__}")
    return data


def read_trainer_config(path) -> TrainerConfig:
    """The run ``path`` (a Hugging Face TrainingArguments / TRL SFTConfig JSON or YAML, or an accelerate config YAML)
    describes (module docstring); a one-line ``MemfitError`` naming any setting memfit cannot model."""
    data = _load(path)
    name = os.path.basename(os.fspath(path))
    if "distributed_type" in data or "compute_environment" in data:
        return _accelerate(path, name, data)
    if looks_like_ds_config(data):  # a ds_config.json: zero_optimization, train_micro_batch_size_per_gpu...
        fields, read = read_ds_config(name, data)
        try:
            return TrainerConfig(os.fspath(path), "deepspeed", Recipe(**fields), read=tuple(read))
        except MemfitError as err:
            raise MemfitError(f"{name}: {err}") from None
    if isinstance(data.get("trainer"), dict):  # a LightningCLI config: trainer:, model:, data:, optimizer:
        from memfit.trainers.lightning import read_lightning

        return read_lightning(path, name, data)
    return _training_arguments(path, name, data)


def _training_arguments(path, name: str, data: dict) -> TrainerConfig:
    from memfit.techniques.optimizer import hf_optim

    known = _training_argument_fields()
    fields: dict = {}
    read: list = []
    seq_len = model = fsdp_config = deepspeed = None
    lora = {}

    def refuse(key, why):
        raise MemfitError(f"{name}: {key}={shown(data[key], 40)} is not modelled: {why}")

    for key, value in data.items():
        if key in _REFUSED:
            default, why = _REFUSED[key]
            defaults = default if isinstance(default, tuple) else (default,)
            if value not in defaults:
                refuse(key, why)
            continue
        if key == "per_device_train_batch_size":
            fields["micro_batch_size"] = _count(name, key, value)
        elif key == "gradient_accumulation_steps":
            fields["grad_accum_steps"] = _count(name, key, value)
        elif key in ("bf16", "fp16"):
            if value is True:
                if fields.get("precision") not in (None, f"{key}-mixed"):
                    raise MemfitError(f"{name}: bf16 and fp16 are both true: the Trainer refuses that too; keep one")
                fields["precision"] = f"{key}-mixed"
            elif value not in (False, None):
                raise MemfitError(f"{name}: {key} must be true or false, got {shown(value, 40)}")
        elif key == "optim":
            fields.update(hf_optim(value))
        elif key in ("gradient_checkpointing", "activation_checkpointing"):  # the second: transformers >= 5.20's name
            if value is True:
                fields["checkpointing"] = "blocks"
            elif value not in (False, None):
                raise MemfitError(f"{name}: {key} must be true or false, got {shown(value, 40)}")
        elif key in ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"):
            if isinstance(value, dict) and value.get("use_reentrant") is True:
                refuse(key, "reentrant checkpointing is not modelled: memfit checkpoints as the Trainer does by "
                            "default (use_reentrant: false)")
            if value is not None and not isinstance(value, dict):
                raise MemfitError(f"{name}: {key} must be a mapping, got {shown(value, 40)}")
            if (value or {}).get("every_n_layers", 1) != 1:
                refuse(key, "checkpointing every n-th layer is not modelled: memfit checkpoints every block "
                            "(every_n_layers: 1) or a selective policy (--checkpointing selective)")
            if (value or {}).get("offload", False) is not False:
                refuse(key, "the Trainer's offload of checkpointed activations is not read: drop it and pass "
                            "--offload-activations to memfit")
            unknown = set(value or {}) - {"use_reentrant", "every_n_layers", "offload"}
            if unknown:
                refuse(key, f"checkpoint arguments other than use_reentrant ({', '.join(sorted(unknown))}) are "
                            "not modelled")
        elif key == "torch_compile":
            if value is True:
                fields["compile"] = True
        elif key == "fsdp":
            fsdp = _trainer_fsdp(name, value)
            if fsdp is None:
                read.append((key, value, "off"))
                continue
            fields.update(fsdp)
        elif key == "fsdp_config":  # read with fsdp, after the loop
            fsdp_config = value
            continue
        elif key == "deepspeed":  # a ds_config path or mapping: merged after the loop
            if value is not None:
                deepspeed = read_ds_config(name, load_ds_config(name, value, os.path.dirname(os.fspath(path))))
            continue
        elif key in ("max_length", "max_seq_length"):  # TRL's SFTConfig (max_seq_length: TRL before 0.20)
            if value is not None:
                seq_len = _count(name, key, value)
        elif key == "activation_offloading":  # TRL's SFTConfig
            if value is True:
                fields["offload_activations"] = True
        elif key == "model_name_or_path":  # TRL's ModelConfig
            if value is not None:
                model = str(value)
        elif key in ("use_peft", "load_in_4bit", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules"):
            lora[key] = value
        elif key not in known and key not in _TRL_NEUTRAL:
            raise MemfitError(f"{name}: {shown(key, 40)} is not a TrainingArguments (or TRL SFTConfig / ModelConfig) "
                              "setting memfit knows: a typo, or another trainer's config; remove it or fix its name")
        else:
            read.append((key, value, _NEUTRAL_NOTE))
            continue
        read.append((key, value, "read"))
    fields.update(_lora(name, lora))
    if deepspeed is not None:
        if fields.get("parallel") == "fsdp":
            raise MemfitError(f"{name}: fsdp and deepspeed are both set: the Trainer runs one engine; keep one")
        fields = merged(fields, deepspeed[0])
        read.extend(deepspeed[1])
    if fields.get("parallel") == "fsdp":
        fsdp_fields = _fsdp(name, fsdp_config or {}, read, prefix="", default_version=2)
        if fields.get("offload") == "cpu":  # fsdp's legacy "offload" option: one offload, said either way
            fsdp_fields.setdefault("offload", "cpu")
        fields.update(fsdp_fields)
        if fields.get("precision") in ("bf16-mixed", "fp16-mixed"):  # accelerate gives FSDP2 the policy too
            fields["mixed_precision"] = fields["precision"].split("-")[0]
    elif fsdp_config:
        read.append(("fsdp_config", fsdp_config, "unused: fsdp is off"))
    trl = [k for k in data if k in _TRL_ONLY]
    unset = [k for k in ("gradient_checkpointing", "bf16") if k not in data]
    if trl and unset:  # TRL's SFTConfig turns both on by default, the Trainer's TrainingArguments neither
        raise MemfitError(f"{name} reads as TRL's SFTConfig ({trl[0]}), whose defaults for {' and '.join(unset)} "
                          "differ from the Trainer's: set them in the file (true or false) so both read it alike")
    if "micro_batch_size" not in fields:  # the Trainer's default
        fields["micro_batch_size"] = 8
        read.append(("per_device_train_batch_size", 8, "the Trainer's default"))
    if "optimizer" not in fields:  # the Trainer's default since transformers 5 (torch >= 2.8)
        fields.update(hf_optim("adamw_torch_fused"))
        read.append(("optim", "adamw_torch_fused", "the Trainer's default"))
    try:
        recipe = Recipe(**fields)
    except MemfitError as err:
        raise MemfitError(f"{name}: {err}") from None
    return TrainerConfig(os.fspath(path), "hf-trainer", recipe, seq_len, model, tuple(read))


# accelerate's config keys (``accelerate config`` writes them) that leave a step's device memory as it is
_ACCELERATE_NEUTRAL = {"compute_environment", "debug", "downcast_bf16", "enable_cpu_affinity", "machine_rank",
                       "main_training_function", "rdzv_backend", "same_network", "tpu_env", "tpu_use_cluster",
                       "tpu_use_sudo", "main_process_ip", "main_process_port", "gpu_ids", "num_cpu_threads_per_process"}
_FSDP_NEUTRAL = {"cpu_ram_efficient_loading", "state_dict_type", "transformer_layer_cls_to_wrap", "sync_module_states",
                 "use_orig_params", "min_num_params"}  # fsdp_config keys, without accelerate's fsdp_ prefix


def _accelerate(path, name: str, data: dict) -> TrainerConfig:
    """An accelerate config YAML (``accelerate config`` / ``accelerate launch --config_file``): the processes, the
    mixed precision (autocast: accelerate wraps the model's forward in it; with FSDP2 also the policy's dtype) and
    FSDP2's settings. The batch is the script's, not the file's: memfit's flags give it."""
    fields: dict = {}
    read: list = []
    deepspeed = None

    def refuse(key, value, why):
        raise MemfitError(f"{name}: {key}={shown(value, 40)} is not modelled: {why}")

    kind = data.get("distributed_type", "NO")
    if kind == "MULTI_GPU":
        fields["parallel"] = "ddp"
    elif kind == "FSDP":
        fields["parallel"] = "fsdp"
    elif kind == "DEEPSPEED":
        fields["parallel"] = "zero2"  # accelerate's default stage, unless its deepspeed_config says
    elif kind not in ("NO", None):
        refuse("distributed_type", kind, "memfit models one GPU (NO), DDP (MULTI_GPU), FSDP2 (FSDP) and DeepSpeed "
                                         "ZeRO (DEEPSPEED)")
    processes = _count(name, "num_processes", data.get("num_processes", 1))
    machines = _count(name, "num_machines", data.get("num_machines", 1))
    if processes % machines:
        raise MemfitError(f"{name}: num_processes={processes} does not split over num_machines={machines}: "
                          "accelerate launches num_processes in all, the same on every machine")
    for key, value in data.items():
        if key in ("distributed_type", "num_processes", "num_machines"):
            read.append((key, value, "read"))
        elif key == "mixed_precision":
            if value in ("bf16", "fp16"):
                fields["precision"] = f"{value}-mixed"
            elif value not in ("no", None):
                refuse(key, value, "memfit models bf16 and fp16 autocast (fp8 through accelerate is not read)")
            read.append((key, value, "read"))
        elif key == "use_cpu":
            if value:
                refuse(key, value, "estimate a CPU run with --device cpu")
        elif key == "fsdp_config":
            if kind != "FSDP":
                read.append((key, value, "unused: distributed_type is not FSDP"))
                continue
            fields.update(_fsdp(name, value or {}, read))
        elif key == "deepspeed_config" and kind == "DEEPSPEED":
            deepspeed = from_accelerate(name, value or {}, os.path.dirname(os.fspath(path)))
            continue
        elif key in ("deepspeed_config", "megatron_lm_config", "fp8_config", "parallelism_config", "dynamo_config",
                     "ipex_config", "mpirun_config"):
            if value:
                refuse(key, value, "only one GPU, DDP and FSDP2 with bf16/fp16 autocast are read from accelerate's "
                                   "config")
        elif key in _ACCELERATE_NEUTRAL:
            read.append((key, value, _NEUTRAL_NOTE))
        else:
            raise MemfitError(f"{name}: {shown(key, 40)} is not an accelerate config setting memfit knows: a typo, or "
                              "another tool's file; remove it or fix its name")
    if kind == "DEEPSPEED":
        ds_fields, ds_read = deepspeed or from_accelerate(name, {}, os.path.dirname(os.fspath(path)))
        fields = merged(fields, ds_fields)
        read.extend(ds_read)
    if fields.get("parallel") == "fsdp" and fields.get("precision") in ("bf16-mixed", "fp16-mixed"):
        # accelerate sets FSDP2's MixedPrecisionPolicy from mixed_precision (AcceleratorState) and wraps the forward
        # in autocast as well
        fields["mixed_precision"] = fields["precision"].split("-")[0]
    try:
        recipe = Recipe(**fields)
    except MemfitError as err:
        raise MemfitError(f"{name}: {err}") from None
    return TrainerConfig(os.fspath(path), "accelerate", recipe, read=tuple(read), gpus=processes // machines,
                         nodes=machines)


def _fsdp(name: str, config: dict, read: list, prefix: str = "fsdp_", default_version: int = 1) -> dict:
    """FSDP2's settings -> memfit's fields: accelerate's ``fsdp_config`` (keys ``fsdp_*``, version 1 unless set) or
    TrainingArguments' (keys with or without ``fsdp_``, version 2 unless set: transformers' own reading)."""
    if not isinstance(config, dict):
        raise MemfitError(f"{name}: fsdp_config must be a mapping of {prefix}* settings (a path to a JSON file is not "
                          "read: put its settings in this file)")
    config = {(k[5:] if k.startswith("fsdp_") else k): v for k, v in config.items()}
    version = config.get("version", default_version)
    if str(version) != "2":
        raise MemfitError(f"{name}: {prefix}version={shown(version, 20)} is not modelled: memfit models FSDP2; set "
                          f"{prefix}version: 2")
    fields = {}
    for key, value in config.items():
        shown_key = prefix + key
        if key == "version":
            pass
        elif key == "reshard_after_forward":
            if value in (True, "true", "True", "FULL_SHARD"):
                fields["reshard_after_forward"] = "true"
            elif value in (False, "false", "False", "SHARD_GRAD_OP"):
                fields["reshard_after_forward"] = "false"
            else:
                raise MemfitError(f"{name}: {shown_key}={shown(value, 20)} is not modelled: set true or false")
        elif key in ("offload_params", "cpu_offload"):  # accelerate's name, transformers' name
            if value in (True, "true", "True"):
                fields["offload"] = "cpu"
        elif key == "activation_checkpointing":
            if value in (True, "true", "True"):
                fields["checkpointing"] = "blocks"
        elif key == "auto_wrap_policy":
            if value not in ("TRANSFORMER_BASED_WRAP", None):
                raise MemfitError(f"{name}: {shown_key}={shown(value, 30)} is not modelled: memfit shards each decoder "
                                  "block and the root (TRANSFORMER_BASED_WRAP)")
        elif key == "xla":
            if value not in (False, None, "false"):
                raise MemfitError(f"{name}: {shown_key}={shown(value, 20)} is not modelled: memfit models FSDP2 on "
                                  "CUDA")
        elif key in _FSDP_NEUTRAL:
            read.append((shown_key, value, _NEUTRAL_NOTE))
            continue
        else:
            raise MemfitError(f"{name}: fsdp_config's {shown(shown_key, 40)} is not an FSDP2 setting memfit reads: "
                              "remove it or fix its name")
        read.append((shown_key, value, "read"))
    return fields


def _trainer_fsdp(name: str, value) -> dict | None:
    """TrainingArguments' ``fsdp``: true, or transformers' legacy options (``"full_shard auto_wrap"``, a list);
    None when off."""
    if value in (None, False, "", []):
        return None
    if value is True:
        return {"parallel": "fsdp"}
    options = value.split() if isinstance(value, str) else value
    if not isinstance(options, list) or not all(isinstance(o, str) for o in options):
        raise MemfitError(f"{name}: fsdp must be true, false or transformers' options (\"full_shard auto_wrap\"), "
                          f"got {shown(value, 40)}")
    fields = {"parallel": "fsdp"}
    for option in options:
        if option == "full_shard":
            fields["reshard_after_forward"] = "true"
        elif option == "shard_grad_op":
            fields["reshard_after_forward"] = "false"
        elif option == "offload":
            fields["offload"] = "cpu"
        elif option != "auto_wrap":
            raise MemfitError(f"{name}: fsdp={shown(value, 40)} is not modelled: memfit reads full_shard, "
                              "shard_grad_op, offload and auto_wrap (FSDP2); for hybrid sharding pass --parallel fsdp "
                              "--shard-over node to memfit")
    return fields


def _lora(name, given: dict) -> dict:
    """TRL's ModelConfig LoRA fields -> memfit's (use_peft: LoRA; with load_in_4bit: QLoRA)."""
    if not given.get("use_peft"):
        if given.get("load_in_4bit"):
            raise MemfitError(f"{name}: load_in_4bit without use_peft trains 4-bit weights, which is not modelled: "
                              "set use_peft: true (QLoRA)")
        return {}
    rank = _count(name, "lora_r", given.get("lora_r", 16))  # TRL's ModelConfig defaults: r 16, alpha 32, dropout 0.05
    fields = {"lora": f"{'qlora' if given.get('load_in_4bit') else 'lora'}:{rank}",
              "lora_alpha": _count(name, "lora_alpha", given.get("lora_alpha", 32))}
    dropout = given.get("lora_dropout", 0.05)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise MemfitError(f"{name}: lora_dropout must be a number from 0 to 1, got {shown(dropout, 40)}")
    fields["lora_dropout"] = float(dropout)
    targets = given.get("lora_target_modules")
    if targets is None:  # peft then picks the model type's own (q_proj and v_proj for a Llama)
        raise MemfitError(f"{name}: use_peft without lora_target_modules leaves the layers to peft's per-model "
                          "defaults, which memfit does not read: set lora_target_modules (all-linear, or names such "
                          "as [q_proj, v_proj])")
    fields["lora_targets"] = targets if isinstance(targets, str) else ",".join(map(str, targets))
    return fields
