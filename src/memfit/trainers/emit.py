"""A memfit recipe written back in the user's own trainer (issue 36, item 2): ``emit(recipe, tool)``.

The tools and what each file is:

- ``hf-trainer``: Hugging Face ``TrainingArguments`` as YAML (``HfArgumentParser.parse_yaml_file`` reads it; a
  LoRA / QLoRA recipe adds TRL's ``SFTConfig`` / ``ModelConfig`` fields, as TRL's ``sft`` script reads them);
- ``accelerate``: an ``accelerate config`` YAML (``accelerate launch --config_file``): processes, mixed precision and
  FSDP2's settings; the batch and the optimizer stay in the user's script and are said in the notes;
- ``lightning``: a LightningCLI config's ``trainer:`` section (``precision``, ``accumulate_grad_batches``,
  ``devices``, ``num_nodes``, ``strategy``); FSDP2 is Lightning's ``ModelParallelStrategy``;
- ``pytorch``: the lines that run the recipe in a plain loop with ``memfit.apply``;
- ``deepspeed``: a ``ds_config.json`` for a ZeRO recipe (``parallel=zero1|zero2|zero3``: ``zero_config.ds_config``,
  which DeepSpeed's own ``DeepSpeedConfig`` accepts in the tests); the optimizer is the script's (a client optimizer).

Each file is what ``read_trainer_config`` reads back to the same recipe where the tool can say all of it (the tests
check both that and the tool's own parser). A recipe field the tool has no setting for is never dropped: it is one of
``Emitted.notes`` (how to apply it by hand, or that ``memfit.apply`` / ``memfit train`` do), as is how to launch the
file over several GPUs.

Why by hand: each tool's config format is its own, and none of them knows memfit's recipe; the mappings are the
inverses of ``read.py``'s.
"""

from __future__ import annotations

import dataclasses

import yaml

from memfit.errors import MemfitError, shown
from memfit.techniques.optimizer import hf_optim_name
from memfit.techniques.recipe import Recipe

__all__ = ["TOOLS", "Emitted", "emit", "within"]

TOOLS = ("hf-trainer", "accelerate", "lightning", "pytorch", "deepspeed")

# searched Recipe fields a tool's config has no setting for, at the value that leaves them out
_UNSAID = {"chunked_loss": 0, "optimizer_in_backward": False, "offload_optimizer": False,
           "activation_memory_budget": 1.0}
_UNSAID_BY = {"hf-trainer": _UNSAID, "accelerate": _UNSAID | {"offload_activations": False},
              "lightning": _UNSAID | {"offload_activations": False}, "pytorch": {}, "deepspeed": _UNSAID}


def within(tools) -> dict:
    """The Recipe fields a plan must leave at their defaults so that every one of ``tools`` can say it
    (``plan(fixed=within(tools))``): chunked loss, optimizer in backward... are memfit's, not the trainers'."""
    out: dict = {}
    for tool in tools:
        out.update(_UNSAID_BY[tool])
    return out


@dataclasses.dataclass(frozen=True)
class Emitted:
    """One tool's config for a recipe: a file name, its text, and what the tool cannot express or how to launch."""

    tool: str
    filename: str
    text: str
    notes: tuple = ()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"notes": list(self.notes)}


def emit(recipe: Recipe, tool: str, *, gpus: int = 1, nodes: int = 1, seq_len: int | None = None,
         model: str | None = None) -> Emitted:
    """``recipe`` (the plan's, with its micro-batch) as ``tool``'s config over ``gpus`` per node x ``nodes``."""
    if not isinstance(recipe, Recipe):
        raise MemfitError(f"emit needs a Recipe, got {type(recipe).__name__}")
    if tool not in TOOLS:
        raise MemfitError(f"--emit {shown(tool, 30)} is not a tool memfit writes: use one of {', '.join(TOOLS)}")
    for name, value in (("gpus", gpus), ("nodes", nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise MemfitError(f"emit: {name} must be a positive whole number, got {shown(value, 20)}")
    return _WRITERS[tool](recipe, gpus, nodes, seq_len, model)


def _changed(recipe: Recipe) -> dict:
    default = Recipe()
    return {n: getattr(recipe, n) for n in Recipe.fields() if getattr(recipe, n) != getattr(default, n)}


def _yaml(data: dict) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


_MESH = {"tp", "sequence_parallel", "loss_parallel", "pp", "pp_schedule", "ep", "cp", "cp_rotate"}


def _by_hand(fields: dict, tool: str) -> list:
    """One note per recipe field the tool has no setting for."""
    return [f"{name}={value}: {tool} has no setting for it; "
            + ("torchtitan runs this mesh (memfit estimates it; memfit train does not run it yet)" if name in _MESH
               else "memfit.apply(model, recipe) applies it to your model, or train with memfit train")
            for name, value in fields.items()]


def _launch(gpus: int, nodes: int, how: str) -> list:
    if gpus * nodes == 1:
        return []
    nnodes = f" --nnodes {nodes} --node-rank R --master-addr HOST" if nodes > 1 else ""
    return [f"launch over {gpus * nodes} GPUs: {how.format(gpus=gpus, nnodes=nnodes, world=gpus * nodes)}"]


# Recipe fields each writer expresses (the rest are notes)
_TRAINER = {"precision", "checkpointing", "optimizer", "optimizer_impl", "micro_batch_size", "grad_accum_steps",
            "compile", "offload_activations", "lora", "lora_targets", "lora_alpha", "lora_dropout", "parallel",
            "reshard_after_forward", "mixed_precision", "offload"}


def _fsdp_policy_note(recipe: Recipe, fields: dict) -> list:
    """With FSDP2, accelerate (and the Trainer through it) runs autocast over a policy of the same dtype: any other
    pair of precision and mixed_precision is not what the tool runs."""
    if recipe.parallel != "fsdp":
        return []
    mixed = recipe.precision.split("-")[0] if recipe.precision.endswith("-mixed") else None
    policy = recipe.mixed_precision.split(":")
    if (mixed is None and recipe.mixed_precision == "none") or (mixed is not None and policy == [mixed]):
        return []
    dtype = mixed or policy[0]
    fields.pop("mixed_precision", None)
    return [f"precision={recipe.precision} with mixed_precision={recipe.mixed_precision}: with FSDP2 accelerate runs "
            f"{dtype} autocast over FSDP2's {dtype} policy (memfit: precision={dtype}-mixed, mixed_precision={dtype}); "
            "the file asks for that, which memfit estimates apart"]


def _hf_trainer(recipe: Recipe, gpus: int, nodes: int, seq_len, model) -> Emitted:
    fields = _changed(recipe)
    notes = _fsdp_policy_note(recipe, fields)
    out: dict = {"per_device_train_batch_size": recipe.micro_batch_size or 1,
                 "gradient_accumulation_steps": recipe.grad_accum_steps}
    mixed = recipe.precision in ("bf16-mixed", "fp16-mixed") or (
        recipe.parallel == "fsdp" and recipe.mixed_precision != "none")
    dtype = recipe.precision.split("-")[0] if recipe.precision.endswith("-mixed") else recipe.mixed_precision[:4]
    out["bf16"] = mixed and dtype == "bf16"
    out["fp16"] = mixed and dtype == "fp16"
    if recipe.precision == "bf16":
        notes.append("precision=bf16 (bf16 weights) is the model's dtype, not a TrainingArguments field: load the model "
                     "with dtype=torch.bfloat16")
    optim = hf_optim_name(recipe.optimizer, recipe.optimizer_impl)
    if optim is None:
        notes.append(f"optimizer={recipe.optimizer} (optimizer_impl={recipe.optimizer_impl}) has no Trainer optim name: "
                     "pass your optimizer with Trainer(optimizers=(optimizer, None))")
    else:
        out["optim"] = optim
    fsdp = recipe.parallel == "fsdp"
    if recipe.checkpointing == "blocks" and not fsdp:
        out["gradient_checkpointing"] = True
        out["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    elif recipe.checkpointing not in ("off", "blocks"):
        notes.append(f"checkpointing={recipe.checkpointing}: the Trainer checkpoints every block or none; memfit.apply "
                     "applies this policy")
    else:
        out["gradient_checkpointing"] = False
    if recipe.compile is True:
        out["torch_compile"] = True
    elif recipe.compile:
        notes.append(f"compile={recipe.compile}: the Trainer compiles the whole model (torch_compile: true) or nothing")
    if recipe.parallel == "ddp":
        notes.append("DDP: the Trainer uses it by itself when launched over several processes")
    elif fsdp:
        if recipe.reshard_after_forward not in ("true", "false"):
            notes.append(f"reshard_after_forward={recipe.reshard_after_forward}: the Trainer reshards fully or not")
        out["fsdp"] = True  # transformers 5: fsdp true and everything in fsdp_config (its strings are deprecated)
        if recipe.offload not in ("none", "cpu"):
            notes.append(f"offload={recipe.offload}: the Trainer's FSDP2 offload is torch's pinned CPUOffloadPolicy "
                         "(offload=cpu) or none")
        out["fsdp_config"] = {"version": 2, "reshard_after_forward": recipe.reshard_after_forward == "true",
                              "cpu_offload": recipe.offload == "cpu",
                              "activation_checkpointing": recipe.checkpointing == "blocks",
                              "auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}
    elif recipe.parallel != "none":
        notes.append(f"parallel={recipe.parallel}: not a Trainer setting")
    trl = recipe.lora != "off" or recipe.offload_activations
    if recipe.lora != "off":
        kind, _, rank = recipe.lora.partition(":")
        out["use_peft"] = True
        out["load_in_4bit"] = kind == "qlora"
        out["lora_r"] = int(rank or 16)
        out["lora_alpha"] = recipe.lora_alpha if recipe.lora_alpha is not None else 2 * int(rank or 16)
        out["lora_dropout"] = recipe.lora_dropout
        targets = recipe.lora_targets
        out["lora_target_modules"] = targets if targets == "all-linear" else targets.split(",")
    if recipe.offload_activations:
        out["activation_offloading"] = True
    if trl:
        notes.append("use_peft, load_in_4bit, lora_* and activation_offloading are TRL's fields (SFTConfig and "
                     "ModelConfig): run this file with TRL's sft script (trl sft --config FILE)")
        if seq_len:
            out["max_length"] = seq_len
    elif seq_len:
        notes.append(f"sequence length {seq_len}: your tokenizer's max_length (TrainingArguments has none)")
    if model and trl:
        repo = _hub_id(model)
        if repo is None:
            notes.append(f"model_name_or_path: {model} is not a Hub id; set it to your model's")
        else:
            out["model_name_or_path"] = repo
    handled = _TRAINER | ({"parallel", "mixed_precision"} if fsdp else set())
    notes += _by_hand({k: v for k, v in fields.items() if k not in handled}, "the Trainer")
    notes += _launch(gpus, nodes, "torchrun --nproc-per-node {gpus}{nnodes} train.py (your Trainer script)")
    return Emitted("hf-trainer", "training_args.yaml", _yaml(out), tuple(notes))


_ACCELERATE = {"precision", "parallel", "reshard_after_forward", "mixed_precision", "offload", "checkpointing"}


def _accelerate(recipe: Recipe, gpus: int, nodes: int, seq_len, model) -> Emitted:
    fields = _changed(recipe)
    notes = _fsdp_policy_note(recipe, fields)
    fsdp = recipe.parallel == "fsdp"
    kind = "FSDP" if fsdp else "MULTI_GPU" if recipe.parallel == "ddp" or gpus * nodes > 1 else "NO"
    mixed = recipe.precision if recipe.precision.endswith("-mixed") else (
        recipe.mixed_precision if fsdp and recipe.mixed_precision != "none" else "no")
    out: dict = {"compute_environment": "LOCAL_MACHINE", "debug": False, "distributed_type": kind,
                 "downcast_bf16": "no", "machine_rank": 0, "main_training_function": "main",
                 "mixed_precision": mixed.split("-")[0].split(":")[0], "num_machines": nodes,
                 "num_processes": gpus * nodes, "rdzv_backend": "static", "same_network": True, "use_cpu": False}
    if fsdp:
        if recipe.offload not in ("none", "cpu"):
            notes.append(f"offload={recipe.offload}: accelerate's FSDP2 offload is torch's pinned CPUOffloadPolicy "
                         "(offload=cpu) or none")
        out["fsdp_config"] = {"fsdp_activation_checkpointing": recipe.checkpointing == "blocks",
                              "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                              "fsdp_cpu_ram_efficient_loading": True,
                              "fsdp_offload_params": recipe.offload == "cpu",
                              "fsdp_reshard_after_forward": recipe.reshard_after_forward == "true",
                              "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_version": 2}
    elif recipe.checkpointing == "blocks":
        notes.append("checkpointing=blocks: call model.gradient_checkpointing_enable("
                     "gradient_checkpointing_kwargs={'use_reentrant': False}) in your script")
    if recipe.precision == "bf16":
        notes.append("precision=bf16 (bf16 weights): load the model with dtype=torch.bfloat16 in your script")
    notes.append(f"in your script: DataLoader(batch_size={recipe.micro_batch_size or 1}), "
                 f"Accelerator(gradient_accumulation_steps={recipe.grad_accum_steps}), and the optimizer "
                 f"{recipe.optimizer} ({recipe.optimizer_impl})")
    handled = _ACCELERATE | {"micro_batch_size", "grad_accum_steps", "optimizer", "optimizer_impl"}
    if not fsdp and recipe.checkpointing not in ("off", "blocks"):
        handled = handled - {"checkpointing"}
    notes += _by_hand({k: v for k, v in fields.items() if k not in handled}, "accelerate's config")
    notes += _launch(gpus, nodes, "accelerate launch --config_file accelerate_config.yaml train.py")
    return Emitted("accelerate", "accelerate_config.yaml", _yaml(out), tuple(notes))


_LIGHTNING_OPTIMIZER = {"adamw": "torch.optim.AdamW", "adam": "torch.optim.Adam", "sgd": "torch.optim.SGD"}
_LIGHTNING_PRECISION = {"fp32": "32-true", "bf16-mixed": "bf16-mixed", "fp16-mixed": "16-mixed", "bf16": "bf16-true"}


def _lightning(recipe: Recipe, gpus: int, nodes: int, seq_len, model) -> Emitted:
    fields = _changed(recipe)
    notes = []
    trainer: dict = {"accelerator": "gpu", "devices": gpus, "num_nodes": nodes,
                     "precision": _LIGHTNING_PRECISION.get(recipe.precision, "32-true"),
                     "accumulate_grad_batches": recipe.grad_accum_steps}
    handled = {"precision", "grad_accum_steps", "micro_batch_size", "optimizer", "optimizer_impl"}
    if recipe.parallel == "ddp" or (recipe.parallel == "none" and gpus * nodes > 1):
        trainer["strategy"] = "ddp"
        handled.add("parallel")
    elif recipe.parallel == "fsdp":
        # Lightning's FSDP2 (DTensor) strategy; its "fsdp" strategy is FSDP1
        trainer["strategy"] = {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
                               "init_args": {"data_parallel_size": gpus * nodes, "tensor_parallel_size": 1}}
        policy = f", mp_policy=MixedPrecisionPolicy(param_dtype=torch.{_TORCH[recipe.mixed_precision.split(':')[0]]})" \
            if recipe.mixed_precision != "none" else ""
        notes.append("FSDP2 under ModelParallelStrategy: in configure_model, fully_shard(block, mesh=self.device_mesh"
                     f"['data_parallel'], reshard_after_forward={recipe.reshard_after_forward == 'true'}{policy}) for "
                     "each decoder block, then fully_shard(self.model)"
                     + (f"; this file cannot say the policy: read it back with --mixed-precision {recipe.mixed_precision}"
                        if recipe.mixed_precision != "none" else ""))
        handled |= {"parallel", "reshard_after_forward", "mixed_precision"}
    else:
        trainer["strategy"] = "auto"
    if recipe.checkpointing == "blocks":
        notes.append("checkpointing=blocks: in configure_model, self.model.gradient_checkpointing_enable("
                     "gradient_checkpointing_kwargs={'use_reentrant': False}) (before fully_shard)")
        handled.add("checkpointing")
    config = {"trainer": trainer, "data": {"batch_size": recipe.micro_batch_size or 1}}
    notes.append("data.batch_size is your LightningDataModule's batch_size argument (LightningCLI passes it)")
    optimizer = _LIGHTNING_OPTIMIZER.get(recipe.optimizer)
    if optimizer is None:
        notes.append(f"optimizer={recipe.optimizer}: return it from configure_optimizers (LightningCLI's optimizer: "
                     "section takes torch's optimizers)")
    else:
        impl = {"fused": {"fused": True}, "foreach": {"foreach": True}}.get(recipe.optimizer_impl, {})
        config["optimizer"] = {"class_path": optimizer} | ({"init_args": impl} if impl else {})
    notes += _by_hand({k: v for k, v in fields.items() if k not in handled}, "Lightning's Trainer")
    notes += _launch(gpus, nodes, "python train.py fit --config lightning.yaml on each node (Lightning starts "
                                  "{gpus} processes per node itself)")
    return Emitted("lightning", "lightning.yaml", _yaml(config), tuple(notes))


_TORCH = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _hub_id(model: str) -> str | None:
    """The Hugging Face repository of a model argument: a Hub id as given, a catalog name's source; else None."""
    from memfit.models.catalog import CATALOG

    entry = CATALOG.get(model.strip().lower())
    if entry is not None:
        return entry.source or None
    return model if model.count("/") == 1 and not model.endswith((".json", "/")) else None


def _pytorch(recipe: Recipe, gpus: int, nodes: int, seq_len, model) -> Emitted:
    fields = _changed(recipe)
    args = ", ".join(f"{k}={v!r}" for k, v in fields.items())
    rows = (recipe.micro_batch_size or 1) * recipe.grad_accum_steps
    text = ("import memfit\n\n"
            f"recipe = memfit.Recipe({args})\n"
            "model, optimizer, step = memfit.apply(model, recipe)\n"
            f"for batch in loader:  # {rows} rows a step: {recipe.micro_batch_size or 1} a micro-batch x "
            f"{recipe.grad_accum_steps}\n"
            "    loss = step(batch)\n")
    notes = _launch(gpus, nodes, "torchrun --nproc-per-node {gpus}{nnodes} train.py")
    return Emitted("pytorch", "train_memfit.py", text, tuple(notes))


def _deepspeed(recipe: Recipe, gpus: int, nodes: int, seq_len, model) -> Emitted:
    import json

    from memfit.techniques.zero_config import ds_config, zero_stage

    if not zero_stage(recipe):
        raise MemfitError(f"--emit deepspeed writes a ZeRO recipe's ds_config.json, and this one is parallel="
                          f"{recipe.parallel}: plan with --parallel zero1, zero2 or zero3")
    config = ds_config(recipe, gpus * nodes, recipe.micro_batch_size or 1)
    said = {"parallel", "zero", "precision", "micro_batch_size", "grad_accum_steps"}
    said |= {"optimizer", "optimizer_impl"}
    notes = _by_hand({k: v for k, v in _changed(recipe).items() if k not in said}, "deepspeed")
    notes.append(f"optimizer={recipe.optimizer}: the script's own, passed to deepspeed.initialize(optimizer=...) (the "
                 "Hugging Face Trainer passes its own when the config has no optimizer section)")
    notes += _launch(gpus, nodes, "deepspeed --num_gpus {gpus}{nnodes} train.py --deepspeed ds_config.json")
    return Emitted("deepspeed", "ds_config.json", json.dumps(config, indent=2) + "\n", tuple(notes))


_WRITERS = {"hf-trainer": _hf_trainer, "accelerate": _accelerate, "lightning": _lightning, "pytorch": _pytorch,
            "deepspeed": _deepspeed}
