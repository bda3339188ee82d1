"""A LightningCLI config (``python train.py fit --config FILE``) in memfit's terms.

The ``trainer:`` section gives the precision (``32-true``, ``bf16-mixed``, ``16-mixed``, ``bf16-true``), the
accumulation (``accumulate_grad_batches``), the processes (``devices`` x ``num_nodes``) and the strategy (``auto``,
``ddp``; Lightning's FSDP2 is ``ModelParallelStrategy``, its ``fsdp`` strategy is FSDP1 and refused). The per-device
batch is read from ``data:`` (``batch_size``, or ``init_args.batch_size``) where the file says it, and the optimizer
from ``optimizer:`` (``torch.optim.AdamW`` and its ``fused`` / ``foreach``); checkpointing and FSDP2's wrapping are
the LightningModule's own code (``configure_model``): give them with memfit's flags. Every other Trainer argument
leaves a step's device memory as it is (logging, checkpoints, validation, limits); a key Lightning's ``Trainer`` does
not take is refused.

Why by hand: Lightning's ``LightningCLI`` parses these files into a Trainer and the user's classes, which needs the
user's code; memfit reads the Trainer's part and names what the user's code decides.
"""

from __future__ import annotations

import os

from memfit.errors import MemfitError, shown
from memfit.techniques.recipe import Recipe
from memfit.trainers.config import _NEUTRAL_NOTE, TrainerConfig, _count

__all__ = ["read_lightning"]

_PRECISION = {"32-true": "fp32", "32": "fp32", 32: "fp32", "bf16-mixed": "bf16-mixed", "16-mixed": "fp16-mixed",
              "16": "fp16-mixed", 16: "fp16-mixed", "bf16-true": "bf16", "bf16": "bf16-mixed"}
# Lightning 2.6's Trainer arguments (its signature), for files read where Lightning is not installed
_TRAINER_ARGS = {
    "accelerator", "strategy", "devices", "num_nodes", "precision", "logger", "callbacks", "fast_dev_run",
    "max_epochs", "min_epochs", "max_steps", "min_steps", "max_time", "limit_train_batches", "limit_val_batches",
    "limit_test_batches", "limit_predict_batches", "overfit_batches", "val_check_interval",
    "check_val_every_n_epoch", "num_sanity_val_steps", "log_every_n_steps", "enable_checkpointing",
    "enable_progress_bar", "enable_model_summary", "accumulate_grad_batches", "gradient_clip_val",
    "gradient_clip_algorithm", "deterministic", "benchmark", "inference_mode", "use_distributed_sampler", "profiler",
    "detect_anomaly", "barebones", "plugins", "sync_batchnorm", "reload_dataloaders_every_n_epochs",
    "default_root_dir", "enable_autolog_hparams", "model_registry"}
_SECTIONS = {"trainer", "model", "data", "optimizer", "lr_scheduler", "seed_everything", "ckpt_path"}
_MODEL_PARALLEL = ("ModelParallelStrategy", "lightning.pytorch.strategies.ModelParallelStrategy")


def _trainer_args() -> set:
    try:
        import inspect

        from lightning.pytorch import Trainer
    except ImportError:
        return _TRAINER_ARGS
    return set(inspect.signature(Trainer.__init__).parameters) - {"self"}


def read_lightning(path, name: str, data: dict) -> TrainerConfig:
    """The run a LightningCLI config describes (module docstring)."""
    unknown = sorted(set(data) - _SECTIONS)
    if unknown:
        raise MemfitError(f"{name}: {shown(unknown[0], 40)} is not a LightningCLI section memfit knows "
                          f"({', '.join(sorted(_SECTIONS))}): remove it or fix its name")
    trainer, fields, read = data["trainer"], {}, []
    known = _trainer_args()
    devices, nodes = 1, 1

    def refuse(key, value, why):
        raise MemfitError(f"{name}: trainer.{key}={shown(value, 40)} is not modelled: {why}")

    for key, value in trainer.items():
        if key not in known:
            raise MemfitError(f"{name}: trainer.{shown(key, 40)} is not an argument of Lightning's Trainer: a typo, or "
                              "another tool's setting; remove it or fix its name")
        if key == "precision":
            if value not in _PRECISION and value is not None:
                refuse(key, value, "memfit models 32-true, bf16-mixed, 16-mixed and bf16-true")
            if value is not None:
                fields["precision"] = _PRECISION[value]
        elif key == "accumulate_grad_batches":
            fields["grad_accum_steps"] = _count(name, f"trainer.{key}", value)
        elif key == "devices":
            if isinstance(value, list):
                devices = len(value) or refuse(key, value, "name at least one device")
            elif isinstance(value, str) and value.isdigit():
                devices = _count(name, f"trainer.{key}", int(value))
            elif isinstance(value, int) and not isinstance(value, bool) and value >= 1:
                devices = value
            else:
                refuse(key, value, "give the number of GPUs per node (auto and -1 depend on the machine: pass "
                                   "--gpus N to memfit)")
        elif key == "num_nodes":
            nodes = _count(name, f"trainer.{key}", value)
        elif key == "accelerator":
            if value == "cpu":
                refuse(key, value, "estimate a CPU run with --device cpu")
        elif key == "strategy":
            fields.update(_strategy(name, value, refuse))
        elif key == "plugins" and value:
            refuse(key, value, "Lightning's precision, environment and checkpoint plugins are not read")
        else:
            read.append((f"trainer.{key}", value, _NEUTRAL_NOTE))
            continue
        read.append((f"trainer.{key}", value, "read"))
    if fields.get("parallel") is None and trainer.get("strategy") in (None, "auto") and devices * nodes > 1:
        fields["parallel"] = "ddp"  # Lightning's auto strategy over several GPUs
    if fields.pop("_dp", None) not in (None, "auto", devices * nodes // fields.get("tp", 1)):
        raise MemfitError(f"{name}: ModelParallelStrategy's data_parallel_size x tensor_parallel_size must be the "
                          f"{devices * nodes} processes of devices x num_nodes")
    batch = _data_batch(name, data.get("data"))
    if batch is not None:
        fields["micro_batch_size"] = batch
        read.append(("data.batch_size", batch, "read"))
    fields.update(_optimizer(name, data.get("optimizer"), read))
    try:
        recipe = Recipe(**fields)
    except MemfitError as err:
        raise MemfitError(f"{name}: {err}") from None
    return TrainerConfig(os.fspath(path), "lightning", recipe, read=tuple(read), gpus=devices, nodes=nodes)


def _strategy(name: str, value, refuse) -> dict:
    if value in (None, "auto", "single_device"):
        return {}
    if isinstance(value, str) and value.startswith("ddp"):
        if value not in ("ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "ddp_find_unused_parameters_true",
                         "ddp_find_unused_parameters_false"):
            refuse("strategy", value, "memfit reads ddp and ModelParallelStrategy (FSDP2)")
        return {"parallel": "ddp"}
    if isinstance(value, dict) and value.get("class_path", "") in _MODEL_PARALLEL + ("lightning.pytorch.strategies."
                                                                                    "model_parallel.ModelParallelStrategy",):
        args = value.get("init_args") or {}
        tp = args.get("tensor_parallel_size", "auto")
        if tp == "auto":
            refuse("strategy", value, "set tensor_parallel_size (auto depends on the machine)")
        tp = _count(name, "tensor_parallel_size", tp)
        out = {"parallel": "fsdp", "_dp": args.get("data_parallel_size", "auto")}
        return out | ({"tp": tp} if tp > 1 else {})
    if value in ("fsdp", "fsdp_cpu_offload") or (isinstance(value, dict) and "FSDPStrategy" in str(value.get(
            "class_path", ""))):
        refuse("strategy", value, "Lightning's fsdp strategy is FSDP1, which memfit does not model: use "
                                  "ModelParallelStrategy (FSDP2) and pass --parallel fsdp to memfit")
    refuse("strategy", value, "memfit reads auto, ddp and ModelParallelStrategy (FSDP2)")


def _data_batch(name: str, data) -> int | None:
    if data is None:
        return None
    if not isinstance(data, dict):
        raise MemfitError(f"{name}: data must be a mapping (LightningCLI's data section)")
    args = data.get("init_args") if isinstance(data.get("init_args"), dict) else data
    value = args.get("batch_size")
    return None if value is None else _count(name, "data.batch_size", value)


def _optimizer(name: str, optimizer, read: list) -> dict:
    """LightningCLI's ``optimizer:`` (class_path + init_args): torch's AdamW, SGD and Adam by their names."""
    if optimizer is None:
        return {}
    if isinstance(optimizer, str):
        optimizer = {"class_path": optimizer}
    if not isinstance(optimizer, dict):
        raise MemfitError(f"{name}: optimizer must be a class path or a mapping with class_path")
    path = str(optimizer.get("class_path", ""))
    args = optimizer.get("init_args") or {}
    kind = {"AdamW": "adamw", "torch.optim.AdamW": "adamw", "Adam": "adam", "torch.optim.Adam": "adam", "SGD": "sgd",
            "torch.optim.SGD": "sgd"}.get(path)
    if kind is None:
        raise MemfitError(f"{name}: optimizer {shown(path, 60)} is not read: memfit reads torch.optim.AdamW, Adam and SGD "
                          "here; pass --optimizer NAME to memfit")
    impl = "fused" if args.get("fused") else "foreach" if args.get("foreach") else "auto"
    read.append(("optimizer.class_path", path, "read"))
    return {"optimizer": kind, "optimizer_impl": impl}
