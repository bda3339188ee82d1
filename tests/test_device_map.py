"""device_map placement (techniques/device_map.py, estimator/placed.py): where from_pretrained puts each
module, and what each GPU and the host hold when the step runs as Accelerate dispatches it."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import memfit
from memfit.errors import MemfitError

CFG = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
           vocab_size=8000, model_type="llama")
SPLIT = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
         "model.layers.2": 1, "model.layers.3": 1, "model.norm": 1, "lm_head": 1}
KW = dict(batch_size=2, seq_len=128, gpu="a100-80gb")


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama") / "config.json"
    LlamaConfig(**CFG).to_json_file(str(path))
    return str(path)


@pytest.fixture(scope="module")
def plain(config):
    """The step on one GPU without a device_map, bf16-mixed: the reference two tests compare with."""
    return memfit.estimate(config, precision="bf16-mixed", fast=False, **KW)


def _param_bytes(names, dtype_size: int) -> int:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**CFG))
    return sum(p.numel() * dtype_size for n, p in model.named_parameters()
               if any(n == k or n.startswith(k + ".") for k in names))


def test_one_gpu_map_is_the_plain_step(config, plain):
    placed = memfit.estimate(config, precision="bf16-mixed", device_map={"": 0}, **KW)
    assert (placed.peak_bytes, placed.reserved_bytes, placed.by_category) == (
        plain.peak_bytes, plain.reserved_bytes, plain.by_category)
    assert [row["device"] for row in placed.devices] == ["cuda:0"]


def test_split_over_two_gpus_puts_each_module_and_its_state_on_its_gpu(config, plain):
    report = memfit.estimate(config, precision="bf16-mixed", device_map=SPLIT, **KW)
    rows = {row["device"]: row for row in report.devices}
    assert set(rows) == {"cuda:0", "cuda:1"}
    for device, index in (("cuda:0", 0), ("cuda:1", 1)):
        names = [k for k, v in SPLIT.items() if v == index]
        params = rows[device]["by_category"]["parameters"]
        assert params == _param_bytes(names, 4)  # fp32 weights of exactly the modules placed there
        # AdamW's two moments follow their parameter's device (zeros_like), plus one 4-byte step each
        state = rows[device]["by_category"]["optimizer_state"]
        assert 2 * params <= state <= 2 * params + 4 * 64
    top = rows[report.device_map["reported"]]
    assert (report.peak_bytes, report.device_bytes) == (top["peak_bytes"], top["device_bytes"])
    assert top["device_bytes"] == max(r["device_bytes"] for r in rows.values())
    # each GPU holds less than the model on one GPU
    assert all(row["peak_bytes"] < plain.peak_bytes for row in rows.values())


def test_a_module_on_the_host_is_copied_in_and_saved_for_backward(config):
    """A frozen lm_head on the host: in bf16 its weight copy is saved for backward (it computes the input's
    gradient), so forward and backward hold it as if it lived on the GPU; only the optimizer phase is
    lighter. Under bf16 autocast the saved tensor is the bf16 cast: every phase is lighter by the fp32
    weight."""
    lm_head = _param_bytes(["lm_head"], 1)  # elements
    for precision, size, same_phases in (("bf16", 2, ("forward", "backward")), ("bf16-mixed", 4, ())):
        recipe = memfit.Recipe(lora="lora:8", precision=precision)
        plain = memfit.estimate(config, recipe=recipe, fast=False, **KW)
        placed = memfit.estimate(config, recipe=recipe, device_map={"model": 0, "lm_head": "cpu"}, **KW)
        host = next(r for r in placed.devices if r["device"] == "cpu")
        assert host["peak_bytes"] == host["by_category"]["parameters"] == lm_head * size
        assert placed.host_bytes == lm_head * size
        for phase in ("forward", "backward", "optimizer"):
            lighter = 0 if phase in same_phases else lm_head * size
            assert placed.phase_peaks[phase] == plain.phase_peaks[phase] - lighter, (precision, phase)
        assert any("copied to cuda:0 each step" in note for note in placed.notes)


@pytest.mark.parametrize("mib, devices", [(10, ["cuda:0", "cuda:1"]), (9, ["cuda:0", "cuda:1", "cpu"])])
def test_auto_places_as_transformers_places_the_real_model(config, mib, devices):
    from transformers.integrations.accelerate import _get_device_map

    budgets = {0: mib * 2**20, 1: mib * 2**20, "cpu": 2**30}
    report = memfit.estimate(config, recipe=memfit.Recipe(lora="lora:8", precision="bf16"), device_map="sequential",
                             max_memory={k: f"{v}B" for k, v in budgets.items()}, **KW)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**CFG), dtype=torch.bfloat16)
    torch_count = torch.cuda.device_count
    torch.cuda.device_count = lambda: 2
    try:
        expected = dict(_get_device_map(model, "sequential", dict(budgets), None))
    finally:
        torch.cuda.device_count = torch_count
    assert report.device_map["entries"] == expected
    assert [row["device"] for row in report.devices] == devices


def test_qlora_seed_stack_fits_one_a100_with_the_whole_model_on_it():
    """The seed's "maximum optimization" stack: Llama-2-70B QLoRA, max_memory={0: "70GB", "cpu": "100GB"}."""
    recipe = memfit.Recipe(lora="qlora:16", precision="bf16-mixed", checkpointing="blocks",
                           optimizer="paged_adamw8bit", micro_batch_size=1, grad_accum_steps=2)
    report = memfit.estimate("llama-2-70b", recipe=recipe, seq_len=512, gpu="a100-80gb", device_map="auto",
                             max_memory={0: "70GB", "cpu": "100GB"})
    assert report.device_map["entries"] == {"": 0}
    assert report.verdict == "fits" and 35 * 2**30 < report.peak_bytes < 45 * 2**30


@pytest.mark.parametrize("kwargs, words", [
    (dict(device_map="auto", max_memory="0=20MB,cpu=1GB", recipe=memfit.Recipe(lora="lora:8")),
     "trainable parameter"),
    (dict(device_map={"model": 0, "lm_head": "disk"}, recipe=memfit.Recipe(lora="lora:8")), "offload folder"),
    (dict(device_map="auto", max_memory="0=5MB,cpu=1GB", recipe=memfit.Recipe(lora="qlora:8", precision="bf16-mixed")),
     "qlora and device_map conflict"),
    (dict(device_map="auto", max_memory="0=seventy"), "not a size"),
    (dict(device_map="auto", max_memory="gpu0=70GB"), "not a device"),
    (dict(max_memory="0=70GB"), "add device_map"),
    (dict(device_map="everywhere"), "device_map must be one of"),
    (dict(device_map={"model.layers.9": 0}), "no module"),
    (dict(device_map={"": 2}, gpus=2), "GPU 2 of 2"),
    (dict(device_map="auto", recipe=memfit.Recipe(parallel="fsdp")), "conflict"),
    (dict(device_map="auto", max_memory="0=1MB,cpu=1MB"), "puts nothing on a GPU"),
])
def test_bad_input_is_one_line(config, kwargs, words):
    with pytest.raises(MemfitError) as err:
        memfit.estimate(config, **KW, **kwargs)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_cli_device_map(config, tmp_path, capsys):
    """In-process (test_cli runs ``python -m memfit.cli`` itself): the flags, the JSON and the exit codes."""
    from memfit.cli import main

    run = ["estimate", config, "--batch-size", "2", "--seq-len", "64", "--gpu", "a100-80gb", "--precision", "bf16"]
    mapping = tmp_path / "map.json"
    mapping.write_text(json.dumps(SPLIT))
    assert main(run + ["--device-map", str(mapping), "--json"]) in (0, None)
    data = json.loads(capsys.readouterr().out)
    assert [r["device"] for r in data["devices"]] == ["cuda:0", "cuda:1"]
    top = next(r for r in data["devices"] if r["device"] == data["device_map"]["reported"])
    assert data["peak_bytes"] == top["peak_bytes"] and data["device_bytes"] == top["device_bytes"]
    assert main(run + ["--device-map", str(mapping), "--forward-only", "--json"]) in (0, None)
    data = json.loads(capsys.readouterr().out)
    assert data["settings"]["workload"] == "forward" and data["phase_peaks"]["backward"] == 0
    assert main(run + ["--device-map", "auto", "--max-memory", "0=lots"]) == 2
    err = capsys.readouterr().err
    assert "not a size" in err and "Traceback" not in err


def _tiny_llama():
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=512))


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16"])
def test_forward_only_matches_the_allocator(precision):
    """workload="forward": the forward without gradients, graded by the CPU allocator's own events."""
    from memfit.estimator.truth import true_peak

    ids = torch.randint(0, 512, (2, 64))
    batch = {"input_ids": ids, "labels": ids}
    estimated = memfit.estimate(_tiny_llama, batch, precision=precision, workload="forward")
    assert estimated.phase_peaks["backward"] == estimated.phase_peaks["optimizer"] == 0
    assert estimated.peak_bytes == true_peak(_tiny_llama, batch, precision=precision, workload="forward")


def test_forward_only_with_layers_on_the_host_holds_one_layer_at_a_time(config):
    """For inference the blocks may live on the host: each block's weights come to the GPU for its forward
    alone (nothing saves them without gradients), so the GPU holds one block's weights at a time."""
    kw = dict(KW, precision="bf16", workload="forward")
    placed = memfit.estimate(config, device_map={"model.embed_tokens": 0, "model.rotary_emb": 0,
                                                 "model.layers": "cpu", "model.norm": 0, "lm_head": 0}, **kw)
    rows = {r["device"]: r for r in placed.devices}
    resident = _param_bytes(["model.embed_tokens", "model.norm", "lm_head"], 2)
    one_block = _param_bytes(["model.layers.0"], 2)
    assert rows["cpu"]["by_category"]["parameters"] == _param_bytes(["model.layers"], 2)
    assert rows["cuda:0"]["by_category"]["parameters"] <= resident + one_block
    plain = memfit.estimate(config, fast=False, **kw)
    assert placed.peak_bytes < plain.peak_bytes


@pytest.mark.parametrize("kwargs, words", [
    (dict(workload="infer"), "workload must be one of"),
    (dict(workload="forward", recipe=memfit.Recipe(parallel="fsdp"), gpus=2), "workload=forward and parallel"),
    (dict(workload="forward", recipe=memfit.Recipe(micro_batch_size=1, grad_accum_steps=2)), "one forward"),
])
def test_bad_workload_is_one_line(config, kwargs, words):
    with pytest.raises(MemfitError, match=words):
        memfit.estimate(config, seq_len=64, batch_size=2, **kwargs)
