"""Where a model comes from: a module, a factory, a catalog name, a config (object or
config.json), or ``pkg.mod:fn``.

A ``Source`` knows how to build the model (on whatever device or fake mode is current), and for
Hugging Face configs how to make a batch of a given size and how to make the same model shallower
(the depth fast path). Nothing here knows about techniques or memory.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Callable

import torch

from memfit.errors import MemfitError
from memfit.models import families, lengths, tasks
from memfit.models.catalog import lookup
from memfit.models.check import check_config, checked_build, import_object, read_config

__all__ = ["Source", "resolve"]

# Config attributes that count repeated blocks, per architecture family.
_DEPTH_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "encoder_layers",
               "decoder_layers")


@dataclass
class Source:
    name: str
    build: Callable[[], torch.nn.Module]
    config: object | None = None  # a transformers PretrainedConfig, when there is one
    task: str | None = None
    module: torch.nn.Module | None = None  # a ready instance passed by the user
    moe_routing: str = "balanced"  # how a mixture-of-experts router splits tokens (cpu_kernels.py)

    @property
    def depth(self) -> int | None:
        if self.config is None:
            return None
        values = {getattr(self.config, k) for k in _DEPTH_KEYS if isinstance(getattr(self.config, k, None), int)}
        # An encoder and a decoder of different depths are not one line in a single depth.
        return values.pop() if len(values) == 1 else None

    def shallow(self, layers: int) -> "Source":
        """The same architecture with ``layers`` blocks (every depth key set to ``layers``)."""
        config = copy.deepcopy(self.config)
        for key in _DEPTH_KEYS:
            if isinstance(getattr(config, key, None), int):
                setattr(config, key, layers)
        types = getattr(config, "layer_types", None)
        settable = getattr(getattr(type(config), "layer_types", None), "fset", True) is not None
        if isinstance(types, list) and settable:  # Mamba derives layer_types from the depth
            config.layer_types = types[:layers]
        shallow = _hf_source(f"{self.name}[{layers} layers]", config, self.task)
        shallow.moe_routing = self.moe_routing
        return shallow

    def default_seq_len(self) -> int | None:
        if self.task == "image-classification":
            return None
        return families.default_seq_len(self.config, self.task)

    def make_batch(self, batch_size: int, seq_len: int | None, layout=None) -> dict[str, torch.Tensor]:
        """A batch this model trains on, built in the current device / fake mode. ``layout`` (a
        ``lengths.MicroBatch``): ``batch_size // layout.rows`` micro-batches of that shape."""
        if self.config is None:
            raise MemfitError(f"{self.name} has no config to build a batch from: pass batch=")
        if layout is not None:
            lengths.check_task(self.task, layout.packed, self.name)
            families.check_seq_len(self.config, self.task, layout.length, self.name)
            return lengths.shape_batch(layout, batch_size // layout.rows, task=self.task)
        if self.task == "image-classification":
            return tasks.labelled_batch(self.config, self.task, batch_size, None)
        seq_len = seq_len or self.default_seq_len()
        families.check_seq_len(self.config, self.task, seq_len, self.name)
        if self.task in families.BATCHES:
            return families.BATCHES[self.task](self.config, batch_size, seq_len)
        if self.task in tasks.LABELLED:
            return tasks.labelled_batch(self.config, self.task, batch_size, seq_len)
        ids = torch.randint(0, self.config.vocab_size, (batch_size, seq_len))
        return {"input_ids": ids, "labels": ids.clone()}


def resolve(model) -> Source:
    """Turn anything the API accepts as ``model`` into a ``Source``."""
    if isinstance(model, Source):
        return model
    if isinstance(model, torch.nn.Module):
        return Source(type(model).__name__, build=lambda: model, module=model)
    if hasattr(model, "model_type") and hasattr(model, "to_dict"):  # a transformers config
        return _hf_source(model.model_type, model, _task(model))
    if callable(model):
        name = getattr(model, "__name__", "factory")
        return Source(name, build=checked_build(model, name, user=True))
    if not isinstance(model, str):
        raise MemfitError(f"cannot use {type(model).__name__} as a model: pass an nn.Module, a factory, "
                          "a catalog name or a config.json path")
    if os.path.exists(model):
        return _from_config_path(model)
    if ":" in model:
        return _from_factory(model)
    if not model.strip():
        raise MemfitError("the model is an empty name: give a catalog name (see `memfit models`), a config.json "
                          "path or package.module:function")
    entry = lookup(model)
    from transformers import AutoConfig

    config = AutoConfig.for_model(entry.model_type, **entry.config)
    return _hf_source(model.lower(), config, entry.task)


_TASKS = {"bert": "masked-lm", "distilbert": "masked-lm", "roberta": "masked-lm", "xlm-roberta": "masked-lm",
          "albert": "masked-lm", "electra": "masked-lm", "deberta": "masked-lm", "deberta-v2": "masked-lm",
          "modernbert": "masked-lm", "t5": "seq2seq", "bart": "seq2seq", "vit": "image-classification"}


def _from_config_path(path: str) -> Source:
    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
    if not os.path.exists(os.path.join(folder, "config.json")):
        raise MemfitError(f"no config.json at {path}: point at a Hugging Face config.json or its folder")
    config = read_config(folder, path)
    return _hf_source(os.path.basename(os.path.abspath(folder)), config, _task(config))


def _task(config) -> str:
    if config.model_type in families.TASKS:
        return families.TASKS[config.model_type]
    if hasattr(config, "vision_config") or hasattr(config, "audio_config"):
        raise MemfitError(f"memfit cannot make a batch for {config.model_type} (multimodal inputs): pass a factory "
                          "and batch=, e.g. estimate(lambda: Model(config), batch)")
    return tasks.task_of(getattr(config, "architectures", None)) or _TASKS.get(config.model_type, "causal-lm")


def _from_factory(spec: str) -> Source:
    return Source(spec, build=checked_build(import_object(spec), spec, user=True))


def _hf_source(name: str, config, task: str) -> Source:
    def build():
        import transformers

        auto = getattr(transformers, tasks.AUTO_CLASSES[task])
        try:
            return auto.from_config(config)
        except ValueError as err:
            raise MemfitError(f"transformers has no {task} model for {config.model_type}: "
                              f"{str(err).splitlines()[0][:120]}") from None

    check_config(config, name)
    config = tasks.with_pad_token(config, task)
    return Source(name, build=checked_build(build, name, user=False), config=config, task=task)
