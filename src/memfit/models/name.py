"""What a model name is, decided once: ``read_name`` turns anything the API accepts as ``model`` into a
``ModelName`` (its kind and the parts it is read by), top to bottom in the order below; ``source.py``
then builds the model from that decision, one builder per kind.

=========  ==================================================  ===========================================
kind       what was passed                                     its parts
=========  ==================================================  ===========================================
module     an ``nn.Module`` instance                           ``obj``
config     a transformers config object                        ``obj``
factory    a callable that returns an ``nn.Module``            ``obj``
file       a model config saved under another name (my.json)   ``path``
folder     a config.json, or a folder holding one              ``path`` (as given), ``folder``
import     ``package.module:function``                         ``label`` (the spec)
hub        a Hugging Face Hub id, ``owner/name``               ``hub_id``, ``revision``, ``catalog``
catalog    a catalog name (``memfit models``)                  ``catalog``
=========  ==================================================  ===========================================

A name that is none of these fails here, in one line naming the fix: a revision for anything but a Hub
id, an empty name, a path that does not exist, a folder without config.json, an unknown catalog name.

Left out, for the builder: reading any file's contents, importing the user's code or transformers, and
the Hub itself (a Hub id's config.json is fetched when the model is built; when it cannot be had and the
catalog holds that repository, ``catalog`` names the entry built instead). An already resolved
``Source`` is not a name: ``resolve`` passes it on as it is.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from memfit.errors import MemfitError, shown
from memfit.models import hub
from memfit.models.catalog import by_source, lookup

__all__ = ["ModelName", "KINDS", "read_name"]

KINDS = ("module", "config", "factory", "file", "folder", "import", "hub", "catalog")


@dataclasses.dataclass(frozen=True)
class ModelName:
    kind: str  # one of KINDS
    label: str  # what reports call the model: a class or model_type, a file or folder name, the spec, id or name
    obj: object = dataclasses.field(default=None, compare=False)  # module, config or factory: the object passed
    path: str = ""  # file, folder: the path as given (messages name it)
    folder: str = ""  # folder: the folder whose config.json is read
    hub_id: str = ""  # hub: owner/name
    revision: str | None = None  # hub: a branch, tag or commit (None: the main branch)
    catalog: str = ""  # catalog: the entry's name; hub: the entry taken from that repository, if any
    trust_remote_code: bool = False  # config, file, folder, hub: run the repository's own code (auto_map)


def read_name(model, *, revision: str | None = None, trust_remote_code: bool = False) -> ModelName:
    """What ``model`` is (see the module's table), or one ``MemfitError`` line naming the fix."""
    if revision is not None and not (isinstance(model, str) and hub.is_hub_id(model)):
        raise MemfitError(f"revision={shown(revision)} is for a Hugging Face Hub id (owner/name): drop it, or name "
                          "the model by its hub id")
    trust = {"trust_remote_code": trust_remote_code}
    if isinstance(model, torch.nn.Module):
        return ModelName("module", type(model).__name__, obj=model)
    if hasattr(model, "model_type") and hasattr(model, "to_dict"):  # a transformers config
        return ModelName("config", model.model_type, obj=model, **trust)
    if callable(model):
        return ModelName("factory", getattr(model, "__name__", "factory"), obj=model)
    if not isinstance(model, str):
        raise MemfitError(f"cannot use {type(model).__name__} as a model: pass an nn.Module, a factory, "
                          "a catalog name, a Hugging Face Hub id or a config.json path")
    if os.path.exists(model):
        return _path(model, trust_remote_code)
    if ":" in model:
        return ModelName("import", model)
    if not model.strip():
        raise MemfitError("the model is an empty name: give a catalog name (see `memfit models`), a Hugging Face "
                          "Hub id (owner/name), a config.json path or package.module:function")
    if hub.is_hub_id(model):
        found = by_source(model) if revision is None else None  # a pinned revision is not the catalog's
        return ModelName("hub", model, hub_id=model, revision=revision, catalog=found[0] if found else "", **trust)
    if "/" in model or model.endswith(".json"):
        raise MemfitError(f"no such file or directory: {model}: give a config.json path, a folder holding one, or "
                          "a Hugging Face Hub id (owner/name)")
    lookup(model)  # an unknown name raises, naming the closest ones
    return ModelName("catalog", model.lower(), catalog=model.strip().lower())


def _path(path: str, trust_remote_code: bool) -> ModelName:
    """A config under any file name, or a config.json (the file, or its folder: ``save_pretrained``, a snapshot)."""
    if os.path.isfile(path) and os.path.basename(path) != "config.json":
        label = os.path.splitext(os.path.basename(path))[0] or os.path.basename(path)
        return ModelName("file", label, path=path, trust_remote_code=trust_remote_code)
    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
    if not os.path.exists(os.path.join(folder, "config.json")):
        raise MemfitError(f"no config.json at {path}: point at a Hugging Face config.json or its folder")
    return ModelName("folder", os.path.basename(os.path.abspath(folder)), path=path, folder=folder,
                     trust_remote_code=trust_remote_code)
