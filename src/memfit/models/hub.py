"""A model named as a user pastes it from the Hugging Face Hub: ``Qwen/Qwen3-8B`` (``revision=``).

Only ``config.json`` is fetched, never weights, through ``huggingface_hub`` itself: the same cache
(``HF_HOME`` / ``HF_HUB_CACHE``), the same offline switch (``HF_HUB_OFFLINE``), the same token (``hf auth
login`` or ``HF_TOKEN``) as ``from_pretrained``. What is written here is what huggingface_hub leaves to
its callers: one line per failure that says what to do, and not waiting 20 s of retries when the Hub
cannot be reached (the cache is read instead, as ``HF_HUB_OFFLINE=1`` would).

Remote code (a ``config.json`` with ``auto_map`` and a ``model_type`` transformers does not know) runs
only when the user passes ``trust_remote_code=True``, as transformers asks.
"""

from __future__ import annotations

import json
import os
import re
import socket
from urllib.parse import urlparse

from memfit.errors import MemfitError

__all__ = ["is_hub_id", "hub_config_file", "needs_remote_code", "known_model_type", "model_type_of", "config_fields",
           "NotCached"]

# owner/name as the Hub spells repository ids (letters, digits, '-', '_', '.'; at most 96 each)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
_PROBE_SECONDS = 3.0


class NotCached(MemfitError):
    """The repository's config.json is neither in the local cache nor reachable."""


def is_hub_id(text: str) -> bool:
    """``owner/name`` that is not a path on this machine."""
    return bool(_HUB_ID.match(text)) and not os.path.exists(text) and not text.endswith(".json")


def _reachable(endpoint: str) -> bool:
    """Whether the Hub's host answers a TCP connection within a few seconds (no DNS, no route: no)."""
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=_PROBE_SECONDS).close()
        return True
    except OSError:
        return False


def hub_config_file(repo_id: str, revision: str | None = None) -> str:
    """The path of ``repo_id``'s config.json in the local Hugging Face cache, downloaded if needed."""
    from huggingface_hub import constants, get_token, hf_hub_download
    from huggingface_hub import errors as hub

    at = f" at revision {revision}" if revision else ""
    offline = constants.HF_HUB_OFFLINE or not _reachable(constants.ENDPOINT)
    try:
        return hf_hub_download(repo_id, "config.json", revision=revision, local_files_only=offline)
    except hub.GatedRepoError:
        if get_token() is None:
            raise MemfitError(f"{repo_id} is gated: accept its licence at {constants.ENDPOINT}/{repo_id} and log in "
                              "with `hf auth login` (or set HF_TOKEN)") from None
        raise MemfitError(f"your Hugging Face token has no access to {repo_id}: accept its licence at "
                          f"{constants.ENDPOINT}/{repo_id}, or log in as another user with `hf auth login`") from None
    except hub.RepositoryNotFoundError:
        login = "" if get_token() else ", or a private one: log in with `hf auth login`"
        raise MemfitError(f"no repository {repo_id} on the Hugging Face Hub (check the spelling{login})") from None
    except hub.RevisionNotFoundError:
        raise MemfitError(f"{repo_id} has no revision {revision!r}: name a branch, tag or commit of it") from None
    except hub.LocalEntryNotFoundError:
        from huggingface_hub import try_to_load_from_cache
        from huggingface_hub.file_download import _CACHED_NO_EXIST

        if try_to_load_from_cache(repo_id, "config.json", revision=revision) is _CACHED_NO_EXIST:
            raise MemfitError(f"{repo_id}{at} has no config.json (not a transformers model): pass a config.json "
                              "path or package.module:function") from None
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else f"{constants.ENDPOINT} cannot be reached"
        close = _cached_like(repo_id, constants.HF_HUB_CACHE)
        if close:
            raise MemfitError(f"{repo_id}{at} is not in the Hugging Face cache and {why}: did you mean "
                              f"{' or '.join(close)}?") from None
        raise NotCached(f"{repo_id}{at} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}: "
                          f"fetch it once with `hf download {repo_id} config.json{' --revision ' + revision if revision else ''}`, "
                          "or pass a config.json path") \
            from None
    except hub.EntryNotFoundError:
        raise MemfitError(f"{repo_id}{at} has no config.json (not a transformers model): pass a config.json "
                          "path or package.module:function") from None
    except hub.HfHubHTTPError as err:
        raise MemfitError(f"the Hugging Face Hub refused config.json of {repo_id}{at}: "
                          f"{str(err).splitlines()[0][:160]}") from None


def _cached_like(repo_id: str, cache: str) -> list[str]:
    """Repositories in the local cache whose ids are close to ``repo_id`` (a typo's likely meaning)."""
    import difflib

    try:
        names = [d[len("models--"):].replace("--", "/") for d in os.listdir(cache) if d.startswith("models--")]
    except OSError:
        return []
    return difflib.get_close_matches(repo_id, names, n=2, cutoff=0.8)


# A config.json is kilobytes; a file this large is weights or data, not read as JSON.
_MAX_CONFIG_BYTES = 64 << 20
_FIX = "a Hugging Face config is one JSON object with model_type (a model's config.json)"


def _fields(path: str) -> dict:
    """The JSON object in the file at ``path``, or one line naming the file and the fix."""
    try:
        if os.path.getsize(path) > _MAX_CONFIG_BYTES:
            raise MemfitError(f"{path} is {os.path.getsize(path) >> 20} MiB, too large for a model config: point at "
                              "the model's config.json (or its folder)")
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as err:
        raise MemfitError(f"{path} is not valid JSON ({err.msg} at line {err.lineno} column {err.colno}): fix the "
                          f"file; {_FIX}") from None
    except UnicodeDecodeError:
        raise MemfitError(f"{path} is not a text file: point at a model's config.json (or its folder)") from None
    except (OSError, ValueError) as err:
        raise MemfitError(f"cannot read {path}: {type(err).__name__}: {err}: point at a model's config.json") from None
    if not isinstance(data, dict):
        raise MemfitError(f"{path} holds a JSON {type(data).__name__}, not a config object: {_FIX}")
    return data


def config_fields(path: str) -> dict:
    """The JSON object in the model config file at ``path`` (of any name), or one line naming the file and the fix."""
    return _fields(path)


def known_model_type(model_type) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return model_type in CONFIG_MAPPING_NAMES


def model_type_of(architectures) -> str | None:
    """The model_type of a config that names only its ``architectures`` (``["LlamaForCausalLM"]``): that of
    the first transformers class among them, or None."""
    import transformers

    for name in architectures if isinstance(architectures, list) else ():
        try:
            found = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
        except Exception:  # noqa: BLE001 — a class whose backend is missing: not one to read a config by
            found = None
        model_type = getattr(getattr(found, "config_class", None), "model_type", None)
        if known_model_type(model_type):
            return model_type
    return None


def needs_remote_code(path: str, name: str, trust_remote_code: bool, data: dict | None = None) -> bool:
    """Whether the config.json at ``path`` (its object ``data`` when read already) can only be read with the
    repository's own code; raises when it can be read by no code memfit may run."""
    import transformers

    data = _fields(path) if data is None else data
    model_type = data.get("model_type")
    if known_model_type(model_type):
        return False
    if "auto_map" in data:
        if not trust_remote_code:
            raise MemfitError(f"{name} runs its own code (auto_map in config.json, model_type {model_type!r} unknown "
                              "to transformers): pass --trust-remote-code (trust_remote_code=True) if you trust it")
        return True
    if model_type is None:
        raise MemfitError(f"{name}: {os.path.basename(path)} has no model_type: fix it (add the model's model_type)")
    raise MemfitError(f"{name}: model_type {model_type!r} is unknown to transformers {transformers.__version__}: "
                      "upgrade transformers (pip install -U transformers)")
