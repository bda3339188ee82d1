"""Where a model comes from: a module, a factory, a catalog name, a config (object, config.json or
its folder), a Hugging Face Hub id (``hub.py``: config.json only), or ``pkg.mod:fn``.

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

from memfit.errors import MemfitError, shown
from memfit.models import families, hub, lengths, quantized, tasks
from memfit.models.catalog import by_source, lookup
from memfit.models.check import check_config, checked_build, config_from_dict, import_object, read_config

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
    quantization: quantized.Quantization | None = None  # the checkpoint's stored format (quantization_config)
    remote_code: bool = False  # built with the repository's own code (trust_remote_code)
    notes: tuple[str, ...] = ()  # what the report should say about where the model came from

    @property
    def depth(self) -> int | None:
        if self.config is None:
            return None
        values = {getattr(self.config, k) for k in _DEPTH_KEYS if isinstance(getattr(self.config, k, None), int)}
        # An encoder and a decoder of different depths are not one line in a single depth.
        return values.pop() if len(values) == 1 else None

    def shallow(self, layers: int | list[int]) -> "Source":
        """The same architecture with fewer blocks: the first ``layers``, or the blocks of those indices
        (``estimator/depth.py`` keeps a model's first, repeated and last kinds of layer). Every depth key
        is set to their number, every per-layer list of the config (``layer_types``, ``no_rope_layers``)
        cut to them, and lists of layer indices (``moe_layers``, ``mlp_only_layers``) renumbered."""
        keep = list(range(layers)) if isinstance(layers, int) else list(layers)
        depth, config = self.depth, copy.deepcopy(self.config)
        for key in _DEPTH_KEYS:
            if isinstance(getattr(config, key, None), int):
                setattr(config, key, len(keep))
        for key, value in list(vars(config).items()):
            if key in ("moe_layers", "mlp_only_layers") and isinstance(value, list):  # indices, not one per layer
                setattr(config, key, [j for j, i in enumerate(keep) if i in value])
            elif isinstance(value, list) and depth and len(value) == depth and key != "layer_types":
                setattr(config, key, [value[i] for i in keep])
        types = getattr(config, "layer_types", None)
        settable = getattr(getattr(type(config), "layer_types", None), "fset", True) is not None
        if isinstance(types, list) and settable:  # Mamba derives layer_types from the depth
            config.layer_types = [types[i] for i in keep if i < len(types)]
        shown_layers = layers if isinstance(layers, int) else len(keep)
        shallow = _hf_source(f"{self.name}[{shown_layers} layers]", config, self.task, self.remote_code)
        shallow.moe_routing, shallow.quantization = self.moe_routing, self.quantization
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
        ids = torch.randint(0, tasks.vocab_size(self.config, self.name), (batch_size, seq_len))
        return {"input_ids": ids, "labels": ids.clone()}


def resolve(model, *, revision: str | None = None, trust_remote_code: bool = False) -> Source:
    """Turn anything the API accepts as ``model`` into a ``Source``: an ``nn.Module``, a factory, a
    transformers config, a config.json or a folder holding one (``save_pretrained``, a downloaded
    snapshot), ``package.module:function``, a catalog name, or a Hugging Face Hub id (``owner/name``;
    only its config.json is fetched, ``revision`` a branch, tag or commit). ``trust_remote_code``: run a
    repository's own configuration and modelling code (``auto_map``), as transformers asks."""
    if revision is not None and not (isinstance(model, str) and hub.is_hub_id(model)):
        raise MemfitError(f"revision={shown(revision)} is for a Hugging Face Hub id (owner/name): drop it, or name "
                          "the model by its hub id")
    if isinstance(model, Source):
        return model
    if isinstance(model, torch.nn.Module):
        return Source(type(model).__name__, build=lambda: model, module=model)
    if hasattr(model, "model_type") and hasattr(model, "to_dict"):  # a transformers config
        return _hf_source(model.model_type, model, _task(model), trust_remote_code)
    if callable(model):
        name = getattr(model, "__name__", "factory")
        return Source(name, build=checked_build(model, name, user=True))
    if not isinstance(model, str):
        raise MemfitError(f"cannot use {type(model).__name__} as a model: pass an nn.Module, a factory, "
                          "a catalog name, a Hugging Face Hub id or a config.json path")
    if os.path.exists(model):
        return _from_config_path(model, trust_remote_code)
    if ":" in model:
        return _from_factory(model)
    if not model.strip():
        raise MemfitError("the model is an empty name: give a catalog name (see `memfit models`), a Hugging Face "
                          "Hub id (owner/name), a config.json path or package.module:function")
    if hub.is_hub_id(model):
        try:
            path = hub.hub_config_file(model, revision)
        except hub.NotCached as err:
            found = by_source(model) if revision is None else None
            if found is None:
                raise
            source = _catalog_source(model, found[1])
            source.notes = (f"{str(err).split(': ')[0]}: read its config.json as memfit's catalog holds it "
                            f"({found[0]}: the public values)",)
            return source
        return _from_config_path(path, trust_remote_code, name=model, hub_id=model, revision=revision)
    if "/" in model or model.endswith(".json"):
        raise MemfitError(f"no such file or directory: {model}: give a config.json path, a folder holding one, or "
                          "a Hugging Face Hub id (owner/name)")
    return _catalog_source(model.lower(), lookup(model))


def _catalog_source(name: str, entry) -> Source:
    from transformers import AutoConfig

    config = AutoConfig.for_model(entry.model_type, **entry.config)
    return _hf_source(name, config, entry.task)


_TASKS = {"bert": "masked-lm", "distilbert": "masked-lm", "roberta": "masked-lm", "xlm-roberta": "masked-lm",
          "albert": "masked-lm", "electra": "masked-lm", "deberta": "masked-lm", "deberta-v2": "masked-lm",
          "modernbert": "masked-lm", "t5": "seq2seq", "bart": "seq2seq", "vit": "image-classification"}


def _from_config_path(path: str, trust_remote_code: bool = False, *, name: str | None = None,
                      hub_id: str | None = None, revision: str | None = None) -> Source:
    if os.path.isfile(path) and os.path.basename(path) != "config.json":
        return _from_config_file(path, trust_remote_code)
    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
    if not os.path.exists(os.path.join(folder, "config.json")):
        raise MemfitError(f"no config.json at {path}: point at a Hugging Face config.json or its folder")
    name = name or os.path.basename(os.path.abspath(folder))
    remote = hub.needs_remote_code(os.path.join(folder, "config.json"), name, trust_remote_code)
    if remote and hub_id is not None:  # the configuration code lives in the repository, beside config.json
        config = read_config(hub_id, name, revision=revision, trust_remote_code=True)
    else:
        config = read_config(folder, path, trust_remote_code=remote)
    return _hf_source(name, config, _task(config), remote)


def _from_config_file(path: str, trust_remote_code: bool) -> Source:
    """A model config saved under any file name (``my-model.json``, ``llama_cfg``): the JSON object in it, read
    as a Hugging Face config when it names a ``model_type`` (or only ``architectures``, whose model_type
    transformers knows). Not the folder's config.json: the file named is the one read."""
    data = hub.config_fields(path)
    name = os.path.splitext(os.path.basename(path))[0] or os.path.basename(path)
    if data.get("model_type") is None:
        model_type = hub.model_type_of(data.get("architectures"))
        if model_type is None:
            what = (f"its architectures {data['architectures']} are unknown to transformers"
                    if data.get("architectures") else "it has no model_type or architectures")
            raise MemfitError(f"{path} is not a Hugging Face model config ({what}): point at a model's config.json, "
                              "or add the model's model_type to the file")
        data = {**data, "model_type": model_type}
    if hub.needs_remote_code(path, name, trust_remote_code, data):
        raise MemfitError(f"{name} runs its own code (auto_map), which transformers finds beside a file named "
                          f"config.json: save {path} as config.json in the folder of that code and pass the folder")
    config = config_from_dict(data, path)
    return _hf_source(name, config, _task(config))


def _task(config) -> str:
    if config.model_type in families.TASKS:
        return families.TASKS[config.model_type]
    if hasattr(config, "vision_config") or hasattr(config, "audio_config"):
        raise MemfitError(f"memfit cannot make a batch for {config.model_type} (multimodal inputs): pass a factory "
                          "and batch=, e.g. estimate(lambda: Model(config), batch)")
    return tasks.task_of(getattr(config, "architectures", None)) or _TASKS.get(config.model_type, "causal-lm")


def _from_factory(spec: str) -> Source:
    return Source(spec, build=checked_build(import_object(spec), spec, user=True))


def _hf_source(name: str, config, task: str, trust_remote_code: bool = False) -> Source:
    quantization = quantized.quantization_of(config)
    if quantization is not None:  # built as the model computes; the stored format is the estimate's note
        config = copy.deepcopy(config)
        del config.quantization_config

    def build():
        import transformers

        auto = getattr(transformers, tasks.AUTO_CLASSES[task])
        extra = {"trust_remote_code": True} if trust_remote_code else {}
        try:  # in the default dtype, as the recipe expects, not the checkpoint's (config.dtype)
            return auto.from_config(config, dtype=torch.get_default_dtype(), **extra)
        except ValueError as err:
            raise MemfitError(f"transformers has no {task} model for {config.model_type}: "
                              f"{str(err).splitlines()[0][:120]}") from None

    check_config(config, name)
    config = tasks.with_pad_token(config, task)
    return Source(name, build=checked_build(build, name, user=trust_remote_code), config=config, task=task,
                  quantization=quantization, remote_code=trust_remote_code)
