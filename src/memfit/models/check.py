"""Checks on where a model comes from: a config's numbers, a config.json file, ``pkg.mod:fn``.

A config with a width of zero, a depth given as a list or a vocabulary of 10^30 would otherwise
fail deep inside transformers or torch, or give a confident number for a model that cannot exist.
Here the sizes that decide memory are checked up front (whole numbers within bounds), and what
transformers, the user's factory or an import raises while building is turned into one
``MemfitError`` line that names the source and the fix. A config is checked once, where it is made:
``read_config`` and ``config_from_dict`` check what they read, ``source.py`` a catalog entry's or a
config object's (``check_config``); a shallower copy of a checked config is not checked again.

Left to the model itself: consistency between fields (a width the head count does not divide);
transformers raises for those when the model is built, and that message is passed on.
"""

from __future__ import annotations

import importlib

import torch

from memfit.errors import MemfitError, shown, user_frame

__all__ = ["check_config", "read_config", "config_from_dict", "import_object", "checked_build"]

# Config fields that are counts or widths, per architecture family; None is allowed where
# transformers fills in a default (head_dim, n_inner, num_key_value_heads).
_DEPTHS = ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers")
_SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
          "max_position_embeddings", "head_dim", "n_embd", "n_head", "n_inner", "n_positions", "d_model", "d_ff",
          "num_heads", "d_kv", "image_size", "patch_size", "num_channels", "num_labels")
_UNBOUNDED = ("max_position_embeddings", "n_positions")  # -1: no position table (XLNet's default)
MAX_DEPTH = 4096  # blocks: the deepest published models have ~160; building more takes minutes
MAX_SIZE = 1 << 27  # widths, vocabularies, positions: 134M, beyond any published model

# What transformers raises for a config it cannot take (huggingface_hub's strict dataclasses raise
# StrictDataclassError, which is not a ValueError).
_BUILD_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, KeyError, AttributeError, IndexError,
                                                  ZeroDivisionError, OverflowError, RuntimeError, AssertionError)
try:
    from huggingface_hub.errors import StrictDataclassError

    _BUILD_ERRORS += (StrictDataclassError,)
except ImportError:  # pragma: no cover — older huggingface_hub
    pass


def check_config(config, name: str) -> None:
    """Raise for a size field that is not a whole number within bounds, and for ``architectures`` that is not a
    list of class names (the head is read from it: a string or numbers there would silently pick none)."""
    arch = _field(config, "architectures")
    if arch is not None and not (isinstance(arch, (list, tuple)) and all(isinstance(a, str) and a for a in arch)):
        raise MemfitError(f"{name}: architectures={shown(arch)} must be a list of class names, e.g. "
                          '["LlamaForCausalLM"]: fix the config')
    for key in _DEPTHS + _SIZES:
        value = _field(config, key)
        if value is None or (key in _UNBOUNDED and value == -1):
            continue
        limit = MAX_DEPTH if key in _DEPTHS else MAX_SIZE
        low = 0 if key in _DEPTHS else 1
        # a size may be given per layer (Gemma-3n's intermediate_size); a depth is one number
        values = value if isinstance(value, list) and value and key in _SIZES else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) and low <= v <= limit for v in values):
            raise MemfitError(f"{name}: {key}={shown(value)} must be a whole number from {low} to {limit}: "
                              "fix the config")


def _field(config, key: str):
    """``config.key``, or None where it has none, or where it varies by layer and the config refuses
    to name one value (Gemma-4's per-layer ``head_dim`` raises a non-AttributeError)."""
    try:
        return getattr(config, key, None)
    except Exception:  # noqa: BLE001 — transformers' per-layer attribute errors share no base class
        return None


def read_config(folder: str, name: str, *, revision: str | None = None, trust_remote_code: bool = False):
    """The transformers config in ``folder``/config.json (or a Hub repository's, with ``revision``), checked."""
    from transformers import AutoConfig

    local = revision is None and not trust_remote_code
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=local, revision=revision,
                                            trust_remote_code=trust_remote_code)
    except _BUILD_ERRORS + (OSError, RecursionError) as err:
        raise MemfitError(f"cannot read {name}: {_message(err)}: fix its config.json") from None
    check_config(config, name)
    return config


def config_from_dict(data: dict, name: str):
    """The transformers config of ``data`` (a config file's JSON object, its ``model_type`` known to
    transformers), checked: what ``AutoConfig.from_pretrained`` makes of a config.json."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        config = CONFIG_MAPPING[data["model_type"]].from_dict(data)
    except _BUILD_ERRORS + (RecursionError,) as err:
        raise MemfitError(f"cannot read {name}: {_message(err)}: fix the file") from None
    check_config(config, name)
    return config


def import_object(spec: str, role: str = "function"):
    """The callable named by ``package.module:function``."""
    module_name, colon, attr = str(spec).partition(":")
    hint = f"write it as package.module:{role}"
    if not colon or not module_name or not attr:
        raise MemfitError(f"cannot import {shown(spec)}: {hint}")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 — importing runs the user's code: any failure is theirs
        raise MemfitError(f"cannot import {shown(spec)}: {_message(err)}; {hint}") from None
    found = getattr(module, attr, None)
    if found is None:
        raise MemfitError(f"cannot import {shown(spec)}: {module_name} has no {shown(attr)}; {hint}")
    if not callable(found):
        raise MemfitError(f"{shown(spec)} is a {type(found).__name__}, not a {role}: name a {role} to call")
    return found


def checked_build(build, name: str, user: bool):
    """``build`` that always returns an ``nn.Module`` or raises one ``MemfitError`` line.

    ``user``: the builder is the user's factory (any exception is reported as theirs); otherwise
    it is transformers building a config, whose errors are the config's.
    """
    caught = Exception if user else _BUILD_ERRORS

    def guarded():
        try:
            module = build()
        except MemfitError:
            raise
        except caught as err:
            what = f"the model factory {name} raised" if user else f"transformers cannot build {name}:"
            fix = "fix the factory or call it yourself" if user else "fix the config"
            where = user_frame(err) if user else None
            raise MemfitError(f"{what} {_message(err)}{f' at {where}' if where else ''}: {fix}") from None
        if not isinstance(module, torch.nn.Module):
            raise MemfitError(f"the model factory {name} returned {type(module).__name__}, not an nn.Module: "
                              "return the model")
        return module

    return guarded


def _message(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
