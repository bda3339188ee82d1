"""Where a model comes from, built: ``resolve`` takes what the name is (``name.py`` decides: a module, a
factory, a catalog name, a config object, config.json or its folder, a Hugging Face Hub id, ``pkg.mod:fn``)
and builds a ``Source`` from that decision, one builder per kind (``_BUILDERS``). A Hugging Face config
is read and checked once (``check.py``), its task read once (``tasks.py``), then made a ``Source``.

A ``Source`` knows how to build the model (on whatever device or fake mode is current), and for
Hugging Face configs how to make a batch of a given size and how to make the same model shallower
(the depth fast path). Nothing here knows about techniques or memory.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, replace
from typing import Callable

import torch

from memfit.errors import MemfitError
from memfit.models import families, hub, lengths, quantized, tasks
from memfit.models.catalog import CATALOG
from memfit.models.check import check_config, checked_build, config_from_dict, import_object, read_config
from memfit.models.name import ModelName, read_name

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
        name = f"{self.name}[{layers if isinstance(layers, int) else len(keep)} layers]"
        # the config was checked and readied for its head when this source was made: only the build is new
        return replace(self, name=name, config=config, notes=(),
                                   build=_auto_build(name, config, self.task, self.remote_code))

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
    if isinstance(model, Source) and revision is None:
        return model  # resolved already: a caller passing on what it resolved
    name = read_name(model, revision=revision, trust_remote_code=trust_remote_code)
    return _BUILDERS[name.kind](name)


def _module(name: ModelName) -> Source:
    return Source(name.label, build=lambda: name.obj, module=name.obj)


def _factory(name: ModelName) -> Source:
    return Source(name.label, build=checked_build(name.obj, name.label, user=True))


def _import(name: ModelName) -> Source:
    return Source(name.label, build=checked_build(import_object(name.label), name.label, user=True))


def _config(name: ModelName) -> Source:
    check_config(name.obj, name.label)
    return _hf_source(name.label, name.obj, trust_remote_code=name.trust_remote_code)


def _catalog(name: ModelName) -> Source:
    from transformers import AutoConfig

    entry = CATALOG[name.catalog]
    config = AutoConfig.for_model(entry.model_type, **entry.config)
    check_config(config, name.label)
    return _hf_source(name.label, config, entry.task)


def _hub(name: ModelName) -> Source:
    """The repository's config.json, read as a local folder's; the catalog's copy when it cannot be had."""
    try:
        path = hub.hub_config_file(name.hub_id, name.revision)
    except hub.NotCached as err:
        if not name.catalog:
            raise
        source = _catalog(name)
        source.notes = (f"{str(err).split(': ')[0]}: read its config.json as memfit's catalog holds it "
                        f"({name.catalog}: the public values)",)
        return source
    return _folder(replace(name, path=path, folder=os.path.dirname(path)))


def _folder(name: ModelName) -> Source:
    """A config.json (of a folder, or of a Hub repository in the local cache)."""
    remote = hub.needs_remote_code(os.path.join(name.folder, "config.json"), name.label, name.trust_remote_code)
    if remote and name.hub_id:  # the configuration code lives in the repository, beside config.json
        config = read_config(name.hub_id, name.label, revision=name.revision, trust_remote_code=True)
    else:
        config = read_config(name.folder, name.path, trust_remote_code=remote)
    return _hf_source(name.label, config, trust_remote_code=remote)


def _file(name: ModelName) -> Source:
    """A model config saved under any file name (``my-model.json``, ``llama_cfg``): the JSON object in it, read
    as a Hugging Face config when it names a ``model_type`` (or only ``architectures``, whose model_type
    transformers knows). Not the folder's config.json: the file named is the one read."""
    path = name.path
    data = hub.config_fields(path)
    if data.get("model_type") is None:
        model_type = hub.model_type_of(data.get("architectures"))
        if model_type is None:
            what = (f"its architectures {data['architectures']} are unknown to transformers"
                    if data.get("architectures") else "it has no model_type or architectures")
            raise MemfitError(f"{path} is not a Hugging Face model config ({what}): point at a model's config.json, "
                              "or add the model's model_type to the file")
        data = {**data, "model_type": model_type}
    if hub.needs_remote_code(path, name.label, name.trust_remote_code, data):
        raise MemfitError(f"{name.label} runs its own code (auto_map), which transformers finds beside a file named "
                          f"config.json: save {path} as config.json in the folder of that code and pass the folder")
    return _hf_source(name.label, config_from_dict(data, path))


# kind (name.KINDS) -> the Source of a name of that kind
_BUILDERS = {"module": _module, "config": _config, "factory": _factory, "file": _file, "folder": _folder,
             "import": _import, "hub": _hub, "catalog": _catalog}


def _hf_source(name: str, config, task: str | None = None, trust_remote_code: bool = False) -> Source:
    """A checked Hugging Face config as a ``Source``: readied for its head (``task``, else the config's own) and
    its stored quantization kept aside."""
    task, config = tasks.head(config, task)
    quantization = quantized.quantization_of(config)
    if quantization is not None:  # built as the model computes; the stored format is the estimate's note
        config = copy.deepcopy(config)
        del config.quantization_config
    return Source(name, build=_auto_build(name, config, task, trust_remote_code), config=config, task=task,
                  quantization=quantization, remote_code=trust_remote_code)


def _auto_build(name: str, config, task: str, trust_remote_code: bool):
    """The model of ``config`` with ``task``'s head, by transformers' Auto class, in the current device / fake
    mode."""
    def build():
        import transformers

        auto = getattr(transformers, tasks.AUTO_CLASSES[task])
        extra = {"trust_remote_code": True} if trust_remote_code else {}
        try:  # in the default dtype, as the recipe expects, not the checkpoint's (config.dtype)
            return auto.from_config(config, dtype=torch.get_default_dtype(), **extra)
        except ValueError as err:
            raise MemfitError(f"transformers has no {task} model for {config.model_type}: "
                              f"{str(err).splitlines()[0][:120]}") from None

    return checked_build(build, name, user=trust_remote_code)
