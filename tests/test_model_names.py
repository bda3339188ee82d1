"""What a model name is (models/name.py), decided once before anything is built: each form the API takes
gives its kind and parts, a bad name fails there in one line naming the fix, and ``resolve`` builds from
the decision (models/source.py) the same source as before."""

import json
import os

import pytest
import torch

from memfit.errors import MemfitError
from memfit.models.name import KINDS, ModelName, read_name
from memfit.models.source import _BUILDERS, Source, resolve

CACHE = os.path.join(os.path.dirname(__file__), "fixtures", "hub-cache")
TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 128}


@pytest.fixture
def offline_hub(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", CACHE)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)


def _factory():
    return torch.nn.Linear(2, 2)


def test_every_kind_has_one_builder():
    assert set(_BUILDERS) == set(KINDS)


def test_objects_are_named_by_what_they_are():
    import transformers

    module = torch.nn.Linear(2, 2)
    config = transformers.LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"})
    assert read_name(module) == ModelName("module", "Linear") and read_name(module).obj is module
    assert read_name(config, trust_remote_code=True) == ModelName("config", "llama", trust_remote_code=True)
    assert read_name(_factory) == ModelName("factory", "_factory")
    assert read_name(lambda: module).label == "<lambda>"


def test_paths_name_a_file_or_a_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    (tmp_path / "my-model.json").write_text(json.dumps(TINY))
    folder = read_name(str(tmp_path))
    assert (folder.kind, folder.label, folder.folder, folder.path) == ("folder", tmp_path.name, str(tmp_path),
                                                                       str(tmp_path))
    file = read_name(str(tmp_path / "config.json"))
    assert (file.kind, file.folder, file.path) == ("folder", str(tmp_path), str(tmp_path / "config.json"))
    other = read_name(str(tmp_path / "my-model.json"))
    assert (other.kind, other.label, other.path) == ("file", "my-model", str(tmp_path / "my-model.json"))


def test_strings_that_are_not_paths():
    assert read_name("os:getcwd") == ModelName("import", "os:getcwd")
    assert read_name("GPT2") == ModelName("catalog", "gpt2", catalog="gpt2")
    hub = read_name("Qwen/Qwen3-8B", revision="main")
    assert (hub.kind, hub.hub_id, hub.revision, hub.catalog) == ("hub", "Qwen/Qwen3-8B", "main", "")
    catalog_repo = read_name("google/gemma-3-1b-pt")
    assert (catalog_repo.kind, catalog_repo.catalog) == ("hub", "gemma-3-1b")  # built from it when not cached
    assert read_name("google/gemma-3-1b-pt", revision="main").catalog == ""  # a pinned revision is not the catalog's


@pytest.mark.parametrize("model, kwargs, needle", [
    ("gpt2", {"revision": "main"}, "revision='main' is for a Hugging Face Hub id"),
    (3, {}, "cannot use int as a model: pass an nn.Module"),
    ("  ", {}, "the model is an empty name: give a catalog name"),
    ("no/such/folder", {}, "no such file or directory: no/such/folder: give a config.json path"),
    ("missing.json", {}, "no such file or directory"),
    ("gpt-2", {}, "unknown model 'gpt-2': did you mean"),
])
def test_a_bad_name_fails_before_anything_is_built(model, kwargs, needle):
    with pytest.raises(MemfitError, match=needle):
        read_name(model, **kwargs)


def test_a_folder_without_config_json(tmp_path):
    with pytest.raises(MemfitError, match="no config.json at .*: point at a Hugging Face config.json or its folder"):
        read_name(str(tmp_path))


def test_resolve_builds_from_the_decision(tmp_path, offline_hub):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    source = resolve(str(tmp_path))
    assert (source.name, source.task, source.config.hidden_size) == (tmp_path.name, "causal-lm", 32)
    assert resolve(source) is source
    assert resolve("gpt2").name == "gpt2" and resolve("gpt2").task == "causal-lm"
    hub = resolve("Qwen/Qwen3-8B")
    assert hub.name == "Qwen/Qwen3-8B" and hub.config.num_hidden_layers == 36
    with pytest.raises(MemfitError, match="revision=.* is for a Hugging Face Hub id"):
        resolve(source, revision="main")


def test_a_shallow_source_keeps_what_the_name_decided():
    source = resolve("qwen2.5-0.5b")
    shallow = source.shallow(2)
    assert isinstance(shallow, Source) and shallow.name == "qwen2.5-0.5b[2 layers]"
    assert (shallow.task, shallow.config.num_hidden_layers, source.config.num_hidden_layers) == ("causal-lm", 2, 24)
    with torch.device("meta"):
        assert len(shallow.build().model.layers) == 2
