"""A model named as a user pastes it: a Hub id read from a fixture cache laid out as huggingface_hub's
(tests/fixtures/hub-cache, offline), a local snapshot, a revision, remote code, quantised checkpoints,
and the bad input around them (one line, exit 2)."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import memfit
from memfit.errors import MemfitError
from memfit.models.source import resolve

CACHE = os.path.join(os.path.dirname(__file__), "fixtures", "hub-cache")
MAIN = "b968826d9c46dd6066d109eabc6255188de91218"  # refs/main of Qwen/Qwen3-8B in the fixture
OLD = "2069b3fae1114555f3c020c81410e51fa0f656f2"  # an older commit: max_position_embeddings 32768


@pytest.fixture
def offline_hub(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", CACHE)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)


def _cli(*args, cache=CACHE, offline=True):
    env = {**os.environ, "HF_HUB_CACHE": cache, "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("HF_TOKEN", None)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([sys.executable, "-m", "memfit.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def _meta_parameters(source) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in source.build().parameters())


def test_hub_id_reads_config_json_from_the_cache(offline_hub):
    source = resolve("Qwen/Qwen3-8B")
    assert source.name == "Qwen/Qwen3-8B" and source.config.model_type == "qwen3"
    assert (source.config.hidden_size, source.config.num_hidden_layers) == (4096, 36)
    # Qwen3-8B's card: 8.2B parameters
    assert abs(_meta_parameters(source) - 8.19e9) / 8.19e9 < 0.01


def test_revision_and_local_snapshot_folder(offline_hub):
    assert resolve("Qwen/Qwen3-8B").config.max_position_embeddings == 40960
    assert resolve("Qwen/Qwen3-8B", revision=OLD).config.max_position_embeddings == 32768
    snapshot = os.path.join(CACHE, "models--Qwen--Qwen3-8B", "snapshots", MAIN)
    local = resolve(snapshot)
    assert local.config.to_dict() == resolve("Qwen/Qwen3-8B").config.to_dict()
    with pytest.raises(MemfitError, match="no revision|not in the Hugging Face cache"):
        resolve("Qwen/Qwen3-8B", revision="no-such-branch")
    with pytest.raises(MemfitError, match="revision='main' is for a Hugging Face Hub id"):
        resolve("gpt2", revision="main")


def test_checkpoint_dtype_does_not_set_the_recipe_precision(tmp_path):
    """A config.json saying torch_dtype bfloat16 (as every hub checkpoint does) is built in fp32 for an fp32
    recipe: transformers 5 builds from_config in config.dtype unless told otherwise."""
    config = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, vocab_size=256)
    for name, extra in (("plain", {}), ("bf16", {"torch_dtype": "bfloat16"})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **extra}))
    plain = memfit.estimate(str(tmp_path / "plain"), seq_len=16)
    bf16 = memfit.estimate(str(tmp_path / "bf16"), seq_len=16)
    assert bf16.peak_bytes == plain.peak_bytes
    assert bf16.by_category["parameters"] == 4 * bf16.parameters


def test_typos_and_missing_configs_are_one_line(offline_hub):
    with pytest.raises(MemfitError, match="did you mean Qwen/Qwen3-8B"):
        resolve("Qwen/Qwen3-8b")
    with pytest.raises(MemfitError, match="has no config.json"):
        resolve("someone/no-config")
    with pytest.raises(MemfitError, match="'foo_not_in_transformers' is unknown to transformers .*upgrade"):
        resolve("someone/unknown-arch")
    with pytest.raises(MemfitError, match="runs its own code .*--trust-remote-code"):
        resolve("someone/tiny-custom")
    with pytest.raises(MemfitError, match="no such file or directory"):
        resolve("./missing/config.json")


def test_gated_repository_without_a_token_names_hf_auth_login(monkeypatch):
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError

    url = "https://huggingface.co/meta-llama/Llama-3.1-8B/resolve/main/config.json"

    def gated(*args, **kwargs):
        raise GatedRepoError("403 gated", response=httpx2.Response(403, request=httpx2.Request("GET", url)))

    monkeypatch.setattr("huggingface_hub.hf_hub_download", gated)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    with pytest.raises(MemfitError, match="is gated: accept its licence .*`hf auth login`"):
        resolve("meta-llama/Llama-3.1-8B")
    monkeypatch.setattr("huggingface_hub.get_token", lambda: "hf_x")
    with pytest.raises(MemfitError, match="token has no access"):
        resolve("meta-llama/Llama-3.1-8B")


def test_quantised_checkpoints_are_read_as_stored(offline_hub):
    from memfit.estimator.checkpoint import checkpoint_recipe
    from memfit.models.quantized import stored_bytes

    awq = resolve("Qwen/Qwen3-8B-AWQ")
    assert awq.quantization.label == "awq int4 g128" and not hasattr(awq.config, "quantization_config")
    with torch.device("meta"):
        model = awq.build()
    head = model.get_output_embeddings()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    # AWQ: 4-bit values, per 128 inputs an fp16 scale and a 4-bit zero per output; the rest fp16
    quantised = sum(m.weight.numel() // 2 + math.ceil(m.in_features / 128) * m.out_features * 5 // 2 for m in linears)
    rest = sum(p.numel() for p in model.parameters()) - sum(m.weight.numel() for m in linears)
    assert stored_bytes(model, awq.quantization) == quantised + 2 * rest
    recipe, info = checkpoint_recipe(awq, memfit.Recipe(lora="lora:8", precision="bf16-mixed"))
    assert recipe.lora == "qlora:8" and "frozen 4-bit base" in info["training"]
    recipe, info = checkpoint_recipe(awq, memfit.Recipe())
    assert recipe.lora == "off" and "dequantised" in info["training"]
    with pytest.raises(MemfitError, match="QLoRA, which computes in bf16"):
        checkpoint_recipe(awq, memfit.Recipe(lora="lora:8"))
    bnb = resolve("unsloth/Qwen3-8B-bnb-4bit")
    assert bnb.quantization.label == "bitsandbytes nf4" and bnb.quantization.skip == ("lm_head",)


def test_unknown_quant_method_is_refused(tmp_path):
    config = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, vocab_size=256, quantization_config={"quant_method": "hqq"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(MemfitError, match="'hqq' is not one memfit reads"):
        resolve(str(tmp_path))


def test_cli_hub_ids_offline(offline_hub, capsys):
    """In this process through memfit.cli.main (the fixture cache, offline); the environment variables a
    process reads and its exit status: test_cli_no_cache_and_no_network_is_one_line, a real process."""
    from memfit.cli import main

    assert main(["estimate", "Qwen/Qwen3-8B", "--revision", OLD, "--seq-len", "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parameters"] == 8190735360
    assert main(["estimate", "someone/tiny-custom", "--trust-remote-code", "--seq-len", "16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["peak_bytes"] > 0
    for args, text in ((("someone/tiny-custom",), "--trust-remote-code"), (("Qwen/Qwen3-8x",), "did you mean"),
                       (("someone/unknown-arch",), "unknown to transformers")):
        code = main(["estimate", *args])
        err = capsys.readouterr().err
        assert code == 2 and text in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1, err


def test_cli_no_cache_and_no_network_is_one_line(tmp_path):
    done = _cli("estimate", "someone/uncached-model", cache=str(tmp_path), offline=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "not in the Hugging Face cache" in done.stderr
    assert "hf download someone/uncached-model config.json" in done.stderr


def test_a_catalog_model_named_by_its_hub_id_needs_no_cache(monkeypatch, tmp_path):
    """No cache and no network, but the id is the source of a catalog entry: its public config, said so."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    source = resolve("Qwen/Qwen3-8B")
    assert source.name == "Qwen/Qwen3-8B" and "catalog holds it (qwen3-8b" in source.notes[0]
    assert _meta_parameters(source) == 8190735360  # as the real config.json (the fixture cache's) builds it
    with pytest.raises(MemfitError, match="not in the Hugging Face cache"):
        resolve("Qwen/Qwen3-8B", revision=OLD)  # a revision is the Hub's: the catalog has one copy


def test_mxfp4_and_fp8_stored_bytes():
    """gpt-oss's MXFP4 quantises the experts' weights only (4 bits + an 8-bit scale per 32); DeepSeek-V3's
    FP8 every linear but the head, with an fp32 scale per 128 x 128 block."""
    import transformers as tf

    from memfit.models.quantized import quantization_of, stored_bytes

    config = tf.AutoConfig.for_model("gpt_oss", hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                                     num_local_experts=4, num_experts_per_tok=2)
    config.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    q = quantization_of(config)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    experts = [p for n, p in model.named_parameters() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(experts) == 4
    packed = sum(p.numel() // 2 + p.numel() // 32 for p in experts)
    rest = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in experts)
    assert stored_bytes(model, q) == packed + 2 * rest

    config = tf.AutoConfig.for_model("llama", hidden_size=256, intermediate_size=384, num_hidden_layers=1,
                                     num_attention_heads=4, vocab_size=300)
    config.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    q = quantization_of(config)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    blocks = sum(math.ceil(m.out_features / 128) * math.ceil(m.in_features / 128) for m in linears)
    rest = sum(p.numel() for p in model.parameters()) - sum(m.weight.numel() for m in linears)
    assert stored_bytes(model, q) == sum(m.weight.numel() for m in linears) + 4 * blocks + 2 * rest


def test_tiny_awq_checkpoint_through_estimate_and_fit(tmp_path):
    config = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, vocab_size=256, torch_dtype="float16",
                  quantization_config={"quant_method": "awq", "bits": 4, "group_size": 32})
    (tmp_path / "config.json").write_text(json.dumps(config))
    recipe = memfit.Recipe(lora="lora:8", precision="bf16-mixed")
    report = memfit.estimate(str(tmp_path), seq_len=16, recipe=recipe)
    assert report.checkpoint["format"] == "awq int4 g32" and report.settings["recipe"]["lora"] == "qlora:8"
    assert any("frozen 4-bit base" in note for note in report.notes)
    same = memfit.estimate(str(tmp_path), seq_len=16, recipe=recipe.replace(lora="qlora:8"))
    assert same.peak_bytes == report.peak_bytes
    found = memfit.fit(str(tmp_path), budget="64MiB", device="cpu", seq_len=16, recipe=recipe, limit=4)
    assert found.recipe.lora == "qlora:8"
