"""CUDA semantics are the default (issue 33): the card given, else the GPU torch sees, else h100-sxm, named in
the first line; CPU semantics only when asked (device="cpu", --device cpu, MEMFIT_DEVICE=cpu). A generation
under CUDA semantics has reserved bytes, the context, a verdict and the cuBLAS workspace."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

import memfit
from memfit.errors import MemfitError
from memfit.hardware import gpus

TINY = os.path.join(os.path.dirname(__file__), "..", "examples", "tiny-llama", "config.json")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """examples/tiny-llama with 2 blocks instead of 4: what is tested here is the target, not the depth."""
    path = tmp_path_factory.mktemp("config") / "config.json"
    with open(TINY) as f:
        path.write_text(json.dumps(json.load(f) | {"num_hidden_layers": 2}))
    return str(path)


@pytest.fixture
def no_env(monkeypatch):
    """The default as a user gets it: conftest.py sets MEMFIT_DEVICE=cpu for the rest of the suite."""
    monkeypatch.delenv("MEMFIT_DEVICE", raising=False)


def test_estimate_defaults_to_cuda_on_the_default_card(tiny, no_env):
    report = memfit.estimate(tiny, batch_size=2, seq_len=16)
    assert report.device == "cuda" and report.gpu == gpus.DEFAULT_GPU
    assert report.settings["target"] == "default"
    assert report.reserved_bytes is not None and report.verdict == "fits"
    assert report.context_bytes == gpus.gpu(gpus.DEFAULT_GPU).cuda_context_bytes


def test_cpu_only_when_asked(tiny, no_env, monkeypatch):
    assert memfit.estimate(tiny, batch_size=2, seq_len=16, device="cpu").reserved_bytes is None
    given = memfit.estimate(tiny, batch_size=2, seq_len=16, gpu="rtx-4090")
    assert (given.gpu, given.settings["target"]) == ("rtx-4090", "given")
    monkeypatch.setenv("MEMFIT_DEVICE", "cpu")
    report = memfit.estimate(tiny, batch_size=2, seq_len=16)
    assert report.device == "cpu" and report.settings["target"] == "cpu"
    monkeypatch.setenv("MEMFIT_DEVICE", "tpu")
    with pytest.raises(MemfitError, match="MEMFIT_DEVICE"):
        gpus.target()
    with pytest.raises(MemfitError, match="conflict"):
        gpus.target("cpu", "h200")


def _sees(monkeypatch, name: str, memory: int, cc=(9, 0)):
    props = SimpleNamespace(name=name, total_memory=memory, major=cc[0], minor=cc[1])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: props)


def test_the_visible_gpu_is_the_card(no_env, monkeypatch):
    _sees(monkeypatch, "NVIDIA H200", 150_000_000_000)
    chosen = gpus.target()
    assert (chosen.gpu.name, chosen.how, chosen.device) == ("h200", "visible", "cuda")
    # a card the catalog does not know: its own memory and compute capability, a catalog card's speeds
    _sees(monkeypatch, "NVIDIA RTX PRO 6000 Blackwell", 102_000_000_000, (12, 0))
    card = gpus.target().gpu
    assert card.full_name == "NVIDIA RTX PRO 6000 Blackwell" and card.memory_bytes == 102_000_000_000
    assert card.compute_capability == (12, 0) and card.bf16
    assert gpus.target(card="a100").how == "given"  # --gpu still wins over what is visible


def test_cli_first_line_names_the_card_and_the_verdict(tiny, no_env, capsys):
    from memfit.cli import main

    assert main(["estimate", tiny, "--seq-len", "16", "--budget", "1MiB"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("on the h100-sxm: no GPU visible"), out[:200]
    assert "OUT OF MEMORY" in " ".join(out.split("\n\n")[0].splitlines()[:4])
    assert main(["estimate", tiny, "--seq-len", "16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["settings"]["target"] == "default" and data["gpu"] == "h100-sxm" and data["budget"]["fits"]
    assert main(["estimate", tiny, "--seq-len", "16", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("CPU semantics")


def test_generate_on_cuda_has_reserved_context_verdict_and_the_workspace(tiny, no_env):
    kw = dict(prompt_len=24, new_tokens=3, batch_size=2)
    cpu = memfit.estimate_generate(tiny, device="cpu", **kw)
    cuda = memfit.estimate_generate(tiny, gpu="h100-sxm", **kw)
    assert cpu.reserved_bytes is None and cuda.device == "cuda"
    assert cuda.reserved_bytes >= cuda.peak_bytes and cuda.verdict == "fits"
    assert cuda.context_bytes == gpus.gpu("h100-sxm").cuda_context_bytes
    workspace = gpus.gpu("h100-sxm").cublas_workspace_bytes
    # the cuBLAS workspace (what a CPU-semantics estimate missed on an H200), 512-byte rounding, no CPU scratch
    assert workspace <= cuda.peak_bytes - cpu.peak_bytes + 64 * 1024 <= workspace + 128 * 1024
    assert memfit.estimate_generate(tiny, **kw).settings["target"] == "default"
    tight = memfit.estimate_generate(tiny, gpu="h100-sxm", budget=cuda.outside_bytes + 1024 * 1024, **kw)
    assert tight.verdict == "out_of_memory"
    with pytest.raises(MemfitError, match="budget"):
        memfit.estimate_generate(tiny, device="cpu", budget="1GiB", **kw)


def test_offload_pins_powers_of_two_and_stages_gradients_on_the_gpu(tiny):
    """FSDP2 CPUOffloadPolicy on a GPU: torch's pinned host allocator serves each shard and each gradient's host
    copy from a block of the next power of two (an H200 run of Llama-3.2-3B: 36.25 GB pinned for 25.70 GB of
    shards and gradients, memfit 36.24 GB); each sharded gradient is made on the GPU before its copy."""
    from transformers import AutoConfig, AutoModelForCausalLM

    recipe = memfit.Recipe(parallel="fsdp", offload="cpu", mixed_precision="bf16")
    off = memfit.estimate(tiny, batch_size=2, seq_len=16, recipe=recipe, gpu="h100-sxm", gpus=1)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny))
    sizes = [p.numel() * 4 for p in model.parameters()]
    rounded = 2 * sum(1 << (n - 1).bit_length() for n in sizes)
    assert abs(off.pinned_bytes - rounded) <= 16 and rounded > 2 * sum(sizes)  # gradients: their groups' share
    unstaged = memfit.estimate(tiny, batch_size=2, seq_len=16, recipe=recipe, device="cpu", gpus=1)
    assert unstaged.pinned_bytes == 2 * sum(sizes)  # a CPU-only run pins nothing: the bytes as they are
