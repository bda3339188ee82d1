"""LoRA's layer choice, alpha, dropout and QLoRA's quantised layers: each estimated as the CPU allocator
measures it, each resolved to the layers peft / bitsandbytes really touch, bad values one line."""

import json

import pytest
import torch
import transformers as tf

import memfit
from memfit import MemfitError, Recipe
from memfit.cli import main
from memfit.estimator.truth import true_peak
from memfit.models.zoo import CASES
from memfit.techniques.lora import apply_lora, lora_layers, quantize_base, quantized_layers

QV = {"gpt": "qkv", "hf-llama": "q_proj,v_proj"}  # attention inputs only: torchtune's [q_proj, v_proj]


def _counters(model) -> int:
    """AdamW's 4-byte step counters, one per trainable tensor: the allocator rounds them its own way,
    the one place estimate and allocator differ (as for optimizer_impl)."""
    return 4 * sum(p.requires_grad for p in model.parameters()) + 16


@pytest.mark.parametrize("name", ["gpt", "hf-llama"])
def test_targets_and_dropout_match_the_allocator(name):
    factory, make_batch, loss_fn = CASES[name]
    recipes = {"qv": Recipe(lora="lora:8", lora_targets=QV[name]),
               "qv+dropout": Recipe(lora="lora:8", lora_targets=QV[name], lora_dropout=0.05),
               "all+dropout": Recipe(lora="lora:8", lora_dropout=0.1, lora_alpha=16)}
    est, truth = {}, {}
    for key, recipe in recipes.items():
        batch = make_batch()
        report = memfit.estimate(factory, batch, loss_fn=loss_fn, recipe=recipe)
        est[key], truth[key] = report.peak_bytes, true_peak(factory, batch, loss_fn=loss_fn, recipe=recipe)
        model, _, _ = memfit.apply(factory(), recipe, loss_fn=loss_fn)
        assert abs(est[key] - truth[key]) <= _counters(model), (key, est[key], truth[key])
    # dropout keeps a mask and a dropped copy of every adapted layer's input: the allocator sees it too
    assert est["qv+dropout"] - est["qv"] > 0 and truth["qv+dropout"] - truth["qv"] > 0
    assert abs((est["qv+dropout"] - est["qv"]) - (truth["qv+dropout"] - truth["qv"])) <= 64


def test_targets_resolve_to_the_layers_peft_adapts():
    llama = CASES["hf-llama"][0]()
    assert lora_layers(llama, "q_proj,v_proj") == [f"model.layers.{i}.self_attn.{p}" for i in (0, 1)
                                                   for p in ("q_proj", "v_proj")]
    every = lora_layers(llama)
    assert len(every) == 14 and "lm_head" not in every  # 7 per block, never the head by default
    assert lora_layers(llama, "all-linear,lm_head") == every + ["lm_head"]  # torchtune's apply_lora_to_output
    assert lora_layers(llama, "self_attn.o_proj") == ["model.layers.0.self_attn.o_proj",
                                                      "model.layers.1.self_attn.o_proj"]
    gpt2 = CASES["hf-gpt2"][0]()  # Conv1D layers: peft adapts them, bitsandbytes cannot quantise them
    assert lora_layers(gpt2, "c_attn") == ["transformer.h.0.attn.c_attn", "transformer.h.1.attn.c_attn"]
    wrapped = apply_lora(CASES["hf-llama"][0](), rank=4, targets="q_proj,v_proj", alpha=32, dropout=0.1)
    adapted = [n for n, m in wrapped.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    assert [n.removeprefix("base_model.model.") for n in adapted] == lora_layers(llama, "q_proj,v_proj")
    layer = wrapped.get_submodule(adapted[0])
    assert layer.scaling["default"] == 32 / 4 and layer.lora_dropout["default"].p == 0.1
    default = apply_lora(CASES["hf-llama"][0](), rank=4).get_submodule(adapted[0])
    assert default.scaling["default"] == 2.0 and isinstance(default.lora_dropout["default"], torch.nn.Identity)


def test_an_unknown_target_lists_the_models_linear_layers():
    factory, make_batch, loss_fn = CASES["hf-llama"]
    with pytest.raises(MemfitError, match="lora_targets entry 'c_attn' names no linear layer of LlamaForCausalLM: "
                                          "its layers are q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
                                          "down_proj, lm_head$"):
        memfit.estimate(factory, make_batch(), recipe=Recipe(lora="lora:8", lora_targets="c_attn"))
    with pytest.raises(MemfitError, match="quantize_targets entry 'lm_head' names no quantisable linear layer"):
        quantize_base(factory(), "lm_head")


@pytest.mark.parametrize("value, message", [
    (dict(lora_targets="q_proj;v_proj"), "lora_targets 'q_proj;v_proj' not understood"),
    (dict(lora_targets=""), "lora_targets '' not understood"),
    (dict(lora_targets="q_proj,,v_proj"), "not understood"),
    (dict(lora_alpha=0), "lora_alpha must be an integer from 1"),
    (dict(lora_alpha=8.5), "lora_alpha must be an integer"),
    (dict(lora_dropout=1.0), "lora_dropout must be from 0 up to"),
    (dict(lora_dropout=-0.1), "lora_dropout must be from 0 up to"),
    (dict(lora_dropout="0.1"), "lora_dropout must be a number"),
    (dict(quantize_targets="q_proj v_proj"), "quantize_targets 'q_proj v_proj' not understood"),
])
def test_bad_values_are_one_line(value, message):
    with pytest.raises(MemfitError, match=message):
        Recipe(lora="qlora:8", precision="bf16-mixed", **value)


def test_fields_without_lora_name_both():
    with pytest.raises(MemfitError, match="lora_dropout=0.1 and lora=off conflict"):
        Recipe(lora_dropout=0.1)
    with pytest.raises(MemfitError, match="lora_targets=q_proj and lora=off conflict"):
        Recipe(lora_targets="q_proj")
    with pytest.raises(MemfitError, match="quantize_targets=adapted and lora=lora:8 conflict"):
        Recipe(lora="lora:8", quantize_targets="adapted")
    assert not Recipe(lora="lora:8", lora_targets="q_proj", lora_dropout=0.05).is_exact


def test_quantize_targets_choose_the_4bit_layers():
    llama = CASES["hf-llama"][0]
    every = quantized_layers(llama())
    assert len(every) == 14 and "lm_head" not in every  # QLoRA paper / load_in_4bit: every linear but the head
    assert quantized_layers(llama(), "adapted", "q_proj,v_proj") == lora_layers(llama(), "q_proj,v_proj")
    assert quantized_layers(llama(), "adapted", "all-linear,lm_head") == every  # the head is never quantised
    assert quantized_layers(llama(), "mlp.down_proj") == ["model.layers.0.mlp.down_proj",
                                                          "model.layers.1.mlp.down_proj"]
    model = quantize_base(llama(), "adapted", "q_proj,v_proj")
    four_bit = [n for n, m in model.named_modules() if type(m).__name__ == "Linear4bit"]
    assert four_bit == lora_layers(llama(), "q_proj,v_proj")


def test_qlora_of_adapted_layers_only_matches_the_allocator_and_keeps_the_rest_wide():
    factory, make_batch, _ = CASES["hf-llama"]
    batch = make_batch()
    base = dict(lora="qlora:8", precision="bf16-mixed", lora_targets="q_proj,v_proj")
    every = memfit.estimate(factory, batch, recipe=Recipe(**base))
    adapted = Recipe(**base, quantize_targets="adapted")
    report = memfit.estimate(factory, batch, recipe=adapted)
    truth = true_peak(factory, batch, recipe=adapted)
    model, _, _ = memfit.apply(factory(), adapted)
    assert abs(report.peak_bytes - truth) <= _counters(model), (report.peak_bytes, truth)
    # k, o and the MLP of both blocks stay fp32: 4 bytes a weight instead of 0.5 + the NF4 statistics
    wide = 2 * (128 * 64 + 128 * 128 + 3 * 128 * 256)
    grown = report.by_category["parameters"] - every.by_category["parameters"]
    assert 3.4 * wide < grown < 3.5 * wide, (grown, wide)


NF4_LLAMA = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                 vocab_size=512, max_position_embeddings=128)  # every linear whole groups of 64 x 256 weights


@pytest.mark.parametrize("extra", [{}, {"checkpointing": "blocks"}], ids=["eager", "checkpointed"])
def test_torchao_nf4_qlora_matches_the_allocator(extra):
    """torchtune's QLoRA weights: torchao's NF4Tensor, dequantised eagerly (int64 indices) in forward and backward."""
    config = tf.LlamaConfig(**NF4_LLAMA)
    factory = lambda: tf.LlamaForCausalLM(config)  # noqa: E731
    batch = CASES["hf-llama"][1]()
    recipe = Recipe(lora="qlora:8", precision="bf16-mixed", quant_impl="torchao", **extra)
    report = memfit.estimate(factory, batch, recipe=recipe)
    truth = true_peak(factory, batch, recipe=recipe)
    model, _, _ = memfit.apply(factory(), recipe)
    # checkpointed: 24 bytes more than the counters, as with bitsandbytes' layers (not NF4's)
    assert abs(report.peak_bytes - truth) <= _counters(model) + 32, (report.peak_bytes, truth)
    bnb = memfit.estimate(factory, batch, recipe=recipe.replace(quant_impl="bnb"))
    # the same 4-bit codes and double-quantised scalers, within their statistics' layout (bytes, not the step)
    assert abs(report.by_category["parameters"] - bnb.by_category["parameters"]) < 0.01 * bnb.by_category["parameters"]
    assert report.peak_bytes != bnb.peak_bytes  # another dequantisation: not a relabelling


def test_torchao_nf4_names_a_layer_it_cannot_quantise_and_needs_qlora():
    factory, make_batch, _ = CASES["hf-llama"]  # 128 x 64 weights: half of torchao's 16,384-weight group
    with pytest.raises(MemfitError, match="cannot quantise model.layers.0.self_attn.k_proj: .* has 8192; .* quant_impl=bnb") as err:
        memfit.estimate(factory, make_batch(), recipe=Recipe(lora="qlora:8", precision="bf16-mixed", quant_impl="torchao"))
    assert "\n" not in str(err.value)
    with pytest.raises(MemfitError, match="quant_impl=torchao and lora=lora:8 conflict: only qlora quantises"):
        Recipe(lora="lora:8", quant_impl="torchao")


def test_the_fields_are_cli_flags(tmp_path, capsys):
    config = tmp_path / "config.json"
    CASES["hf-llama"][0]().config.to_json_file(str(config))
    assert main(["estimate", str(config), "--seq-len", "16", "--batch-size", "2", "--lora", "lora:4",
                 "--lora-targets", "q_proj,v_proj", "--lora-alpha", "8", "--lora-dropout", "0.05", "--json"]) == 0
    recipe = json.loads(capsys.readouterr().out)["settings"]["recipe"]
    assert (recipe["lora_targets"], recipe["lora_alpha"], recipe["lora_dropout"]) == ("q_proj,v_proj", 8, 0.05)
    assert main(["estimate", str(config), "--seq-len", "16", "--lora", "lora:4", "--lora-targets", "wq"]) == 2
    assert "its layers are q_proj" in capsys.readouterr().err


def test_fast_path_equals_full_trace_with_targets_dropout_and_bf16_adapters():
    # 6 blocks: past the 4 the depth path traces (first, second, middle, last), so fast=True writes 2 out
    config = tf.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=6, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
                            architectures=["LlamaForCausalLM"])
    recipe = Recipe(lora="qlora:8", precision="bf16-mixed", lora_targets="q_proj,v_proj,down_proj",
                    lora_dropout=0.05, quantize_targets="adapted")
    fast = memfit.estimate(config, recipe=recipe, batch_size=2, seq_len=64, gpu="rtx-4090", fast=True)
    full = memfit.estimate(config, recipe=recipe, batch_size=2, seq_len=64, gpu="rtx-4090", fast=False)
    assert fast.method == "depth" and fast.peak_bytes == full.peak_bytes
    assert fast.reserved_bytes == full.reserved_bytes and fast.trainable == full.trainable
    bf16 = Recipe(lora="lora:8", precision="bf16", lora_targets="q_proj,v_proj", lora_dtype="bf16")
    fast = memfit.estimate(config, recipe=bf16, batch_size=2, seq_len=64, gpu="rtx-4090", fast=True)
    full = memfit.estimate(config, recipe=bf16, batch_size=2, seq_len=64, gpu="rtx-4090", fast=False)
    assert fast.method == "depth" and (fast.peak_bytes, fast.reserved_bytes) == (full.peak_bytes, full.reserved_bytes)


class _Own4bit(torch.nn.Module):
    """A model that builds its own bitsandbytes 4-bit layers (as Fabric's BitsandbytesPrecision does) and
    its own trainable part: no peft, no recipe lora."""

    def __init__(self):
        import bitsandbytes as bnb

        super().__init__()
        self.up = bnb.nn.Linear4bit(64, 256, compute_dtype=torch.bfloat16, quant_type="nf4", compress_statistics=True)
        self.down = bnb.nn.Linear4bit(256, 64, bias=False, compute_dtype=torch.bfloat16, quant_type="fp4",
                                      compress_statistics=False)
        self.adapter = torch.nn.Linear(64, 64, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x + self.adapter(x)))).float().pow(2).mean()


def test_a_models_own_4bit_layers_are_quantised_before_the_step_and_match_the_allocator():
    recipe = Recipe(precision="bf16")
    batch = {"x": torch.randn(4, 32, 64)}
    loss_fn = lambda model, b: model(b["x"].to(torch.bfloat16))  # noqa: E731
    report = memfit.estimate(_Own4bit, batch, loss_fn=loss_fn, recipe=recipe)
    truth = true_peak(_Own4bit, batch, loss_fn=loss_fn, recipe=recipe)
    assert abs(report.peak_bytes - truth) <= 4 + 16, (report.peak_bytes, truth)
    # each layer quantised with its own settings: 0.5 byte a weight, the trainable adapter left as it is
    weights = report.by_category["parameters"]
    assert (64 * 256 + 256 * 64) // 2 + 64 * 64 * 2 < weights < (64 * 256 + 256 * 64) // 2 + 64 * 64 * 2 + 4096
    assert report.trainable == 64 * 64 + 256  # the adapter and the 4-bit layer's bias


@pytest.mark.parametrize("lora", ["lora:8", "qlora:8"])
def test_bf16_adapters_match_the_allocator_and_halve_the_adapters(lora):
    """torchtune's layout: adapters in the model's bf16 (peft's autocast_adapter_dtype=False), not fp32."""
    factory, make_batch, loss_fn = CASES["hf-llama"]
    batch = make_batch()
    wide, narrow = (Recipe(lora=lora, precision="bf16", lora_targets="q_proj,v_proj", lora_dtype=d)
                    for d in ("fp32", "bf16"))
    model, _, _ = memfit.apply(factory(), narrow, loss_fn=loss_fn)
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    assert adapters and all(p.dtype == torch.bfloat16 and p.requires_grad for p in adapters)
    report = memfit.estimate(factory, batch, loss_fn=loss_fn, recipe=narrow)
    truth = true_peak(factory, batch, loss_fn=loss_fn, recipe=narrow)
    assert abs(report.peak_bytes - truth) <= _counters(model), (report.peak_bytes, truth)
    # the adapters' weights and both AdamW moments: 2 bytes a value less each, at least, at the peak
    n = sum(p.numel() for p in adapters)
    saved = memfit.estimate(factory, batch, loss_fn=loss_fn, recipe=wide).peak_bytes - report.peak_bytes
    assert saved >= 3 * 2 * n, (saved, n)


def test_bf16_adapters_need_pure_bf16():
    with pytest.raises(MemfitError, match="lora_dtype=bf16 and precision=bf16-mixed conflict"):
        Recipe(lora="lora:8", precision="bf16-mixed", lora_dtype="bf16")
    with pytest.raises(MemfitError, match="lora_dtype=bf16 and lora=off conflict"):
        Recipe(precision="bf16", lora_dtype="bf16")
    with pytest.raises(MemfitError, match="lora_dtype"):
        Recipe(lora="lora:8", precision="bf16", lora_dtype="fp16")
