"""Every common model family, estimated on fake tensors and graded by the CPU allocator.

Each model is built from a config.json written to a temporary folder (as a user would point
memfit at one), at a tiny size so the real run that is the truth takes a second or two.
"""

import json

import pytest
import torch

import memfit
from memfit.errors import MemfitError
from memfit.models.catalog import CATALOG
from memfit.models.source import resolve
from memfit.estimator.truth import true_peak

TOLERANCE = 0.005

_LM = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)

CONFIGS = {
    "mixtral": dict(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=4,
                    num_experts_per_tok=2, **_LM),
    "qwen2_moe": dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2, **_LM),
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], moe_intermediate_size=32,
                      num_experts=8, num_experts_per_tok=2, head_dim=16, **_LM),
    "mamba": dict(model_type="mamba", architectures=["MambaForCausalLM"], hidden_size=64, num_hidden_layers=2,
                  vocab_size=256, state_size=8),
    "mamba2": dict(model_type="mamba2", architectures=["Mamba2ForCausalLM"], hidden_size=64, num_hidden_layers=2,
                   vocab_size=256, state_size=8, num_heads=8, head_dim=16, n_groups=1, chunk_size=16, expand=2),
    "whisper": dict(model_type="whisper", architectures=["WhisperForConditionalGeneration"], d_model=64,
                    encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                    encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=256, num_mel_bins=16,
                    max_source_positions=32, max_target_positions=64, decoder_start_token_id=1, pad_token_id=0,
                    bos_token_id=1, eos_token_id=2),
    "llava": dict(model_type="llava", architectures=["LlavaForConditionalGeneration"],
                  vision_config=dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4, image_size=56, patch_size=14,
                                     projection_dim=64),
                  text_config=dict(model_type="llama", **{**_LM, "vocab_size": 300}),
                  image_token_id=256, image_seq_length=16),
}


def _source(tmp_path, family):
    (tmp_path / "config.json").write_text(json.dumps(CONFIGS[family]))
    return resolve(str(tmp_path / "config.json"))


def _graded(source, precision, seq_len=32):
    torch.manual_seed(0)
    batch = source.make_batch(2, seq_len)
    report = memfit.estimate(source.build, batch, precision=precision)
    truth = true_peak(source.build, batch, precision=precision)
    return report, truth


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_family_matches_allocator(tmp_path, family, precision):
    source = _source(tmp_path, family)
    report, truth = _graded(source, precision)
    assert abs(report.peak_bytes - truth) / truth < TOLERANCE, (report.peak_bytes, truth)
    assert report.unprobed_ops == 0


def test_tasks_and_batches_follow_the_family(tmp_path):
    assert _source(tmp_path, "whisper").task == "speech-seq2seq"
    batch = _source(tmp_path, "whisper").make_batch(2, 20)
    assert batch["input_features"].shape == (2, 16, 64) and batch["labels"].shape == (2, 20)
    llava = _source(tmp_path, "llava")
    batch = llava.make_batch(2, 40)
    assert llava.task == "image-text-to-text"
    assert (batch["input_ids"] == 256).sum(1).tolist() == [16, 16]  # one image's tokens per row
    assert batch["pixel_values"].shape == (2, 3, 56, 56)


@pytest.mark.parametrize("model, limit", [("gpt2", 1024), ("bert-base", 512)])
def test_sequence_past_the_position_table_is_one_line(model, limit):
    with pytest.raises(MemfitError, match=f"has {limit} positions") as err:
        memfit.estimate(model, seq_len=2048)
    assert "\n" not in str(err.value)


def test_distilbert_config_json_names_its_limit(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="distilbert", architectures=["DistilBertForMaskedLM"], dim=64, hidden_dim=128, n_layers=2,
        n_heads=4, vocab_size=256, max_position_embeddings=64)))
    with pytest.raises(MemfitError, match="has 64 positions .max_position_embeddings.*--seq-len 64"):
        memfit.estimate(str(tmp_path / "config.json"), seq_len=128)
    assert memfit.estimate(str(tmp_path / "config.json"), seq_len=64).peak_bytes > 0


def test_rotary_and_state_space_models_have_no_position_limit(tmp_path):
    # max_position_embeddings=128 is a training length for a rotary model, not a table size
    assert memfit.estimate(_source(tmp_path, "mixtral"), seq_len=256).peak_bytes > 0
    assert memfit.estimate(_source(tmp_path, "mamba2"), seq_len=160, fast=False).peak_bytes > 0


DEEP = [("mamba", ["num_hidden_layers"]), ("mamba2", ["num_hidden_layers"]), ("mixtral", ["num_hidden_layers"]),
        ("whisper", ["encoder_layers", "decoder_layers"])]


@pytest.mark.parametrize("family, keys", DEEP)
def test_depth_fast_path_agrees_with_full_trace(tmp_path, family, keys):
    config = {**CONFIGS[family], **{key: 8 for key in keys}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    path = str(tmp_path / "config.json")
    fast = memfit.estimate(path, seq_len=8)
    full = memfit.estimate(path, seq_len=8, fast=False)
    assert fast.method == "depth" and full.method == "fake"
    assert fast.peak_bytes == full.peak_bytes


@pytest.mark.parametrize("family, keys", DEEP)
def test_written_log_is_the_full_trace_log_on_cpu(tmp_path, family, keys):
    """Event for event (kernel scratch sites aside: they keep the shallow copy's). Mamba's conv
    fallback calls a fresh activation module that is no submodule of the model, and CPU AdamW
    loops over parameters (``foreach=False``), freeing a block's last temporary in the next block."""
    from memfit.accounting.ledger import ALLOC, FREE, SPIKE
    from memfit.accounting.synth import synthesise
    from memfit.estimator.fake_trace import fake_trace
    from memfit.techniques.recipe import recipe_from

    (tmp_path / "config.json").write_text(json.dumps({**CONFIGS[family], **{key: 8 for key in keys}}))
    source = resolve(str(tmp_path / "config.json"))
    recipe, factory = recipe_from(memfit.Recipe(), "fp32", "adamw")

    def trace(src):
        return fake_trace(src, None, recipe=recipe, loss_fn=None, optimizer=factory, steps=2, batch_size=1,
                          seq_len=8, keep=True)[1].ledger

    def events(ledger):
        return [(kind, ledger.records[i].nbytes, ledger.records[i].category, ledger.records[i].module)
                if kind in (ALLOC, FREE) else (kind, None if kind == SPIKE else i) for kind, i in ledger.events]
    log = synthesise(trace(source.shallow(4)), depth=8)
    assert log.unmatched == 0
    assert events(log) == events(trace(source))


# Parameter counts published on the model cards (whisper-small's card rounds 241.7M to 244M).
PUBLISHED = {"mixtral-8x7b": 46.7e9, "qwen1.5-moe-a2.7b": 14.3e9, "qwen3-30b-a3b": 30.5e9,
             "whisper-large-v3": 1.55e9, "llava-1.5-7b": 7.06e9, "mamba-130m": 0.129e9}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_new_catalog_entries_match_published_sizes(name):
    assert name in CATALOG
    report = memfit.estimate(name, seq_len=600 if name.startswith("llava") else 32)
    assert abs(report.parameters - PUBLISHED[name]) / PUBLISHED[name] < 0.01


def _forced_router(build, routing):
    """``build`` with every MoE router's choice replaced: ``balanced`` spreads each token's top_k
    picks round-robin over the experts, ``worst`` sends every token to experts 0..top_k-1."""
    def hook(module, args, out):
        logits, scores, index = out
        tokens, k = index.shape
        if routing == "worst":
            forced = torch.arange(k).expand(tokens, k).clone()
        else:
            forced = (torch.arange(tokens)[:, None] * k + torch.arange(k)) % module.num_experts
        return logits, scores, forced

    def forced_build():
        model = build()
        for module in model.modules():
            if type(module).__name__.endswith("TopKRouter"):
                module.register_forward_hook(hook)
        return model
    return forced_build


@pytest.mark.parametrize("routing", ["balanced", "worst"])
def test_moe_routing_matches_the_forced_real_routing_in_bf16(tmp_path, routing):
    # Pure bf16 is where routing shows: the CPU grouped_mm converts each expert's rows to fp32.
    build = _forced_router(_source(tmp_path, "mixtral").build, routing)
    batch = resolve(str(tmp_path / "config.json")).make_batch(2, 32)
    report = memfit.estimate(build, batch, precision="bf16", moe_routing=routing)
    truth = true_peak(build, batch, precision="bf16")
    assert abs(report.peak_bytes - truth) / truth < TOLERANCE, (report.peak_bytes, truth)


def test_moe_routing_changes_only_bf16_kernel_scratch(tmp_path):
    build = _source(tmp_path, "mixtral").build
    batch = resolve(str(tmp_path / "config.json")).make_batch(2, 32)
    truths = {(r, p): true_peak(_forced_router(build, r), batch, precision=p)
              for r in ("balanced", "worst") for p in ("fp32", "bf16")}
    assert truths["balanced", "fp32"] == truths["worst", "fp32"]  # every expert tensor is tokens x top_k
    # where the CPU converts bf16 expert rows to fp32 the worst routing needs more scratch; on a CPU
    # with native bf16 matmuls (AMX, AVX512-BF16: no conversion) the two are equal
    assert truths["worst", "bf16"] >= truths["balanced", "bf16"]
    with pytest.raises(MemfitError, match="balanced, worst"):
        memfit.estimate(build, batch, moe_routing="uniform")


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_collapsed_mamba_scan_matches_the_real_loop_at_a_longer_sequence(tmp_path, precision):
    # The fake trace collapses the per-token loop (models/mamba_scan.py); the real run loops.
    source = _source(tmp_path, "mamba")
    report, truth = _graded(source, precision, seq_len=128)
    assert abs(report.peak_bytes - truth) / truth < TOLERANCE, (report.peak_bytes, truth)


def test_a_vision_language_model_without_a_batch_recipe_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="qwen2_vl", architectures=["Qwen2VLForConditionalGeneration"],
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4))))
    with pytest.raises(MemfitError, match="cannot make a batch for qwen2_vl.*batch=") as err:
        memfit.estimate(str(tmp_path / "config.json"), seq_len=32)
    assert "\n" not in str(err.value)


def test_moe_reports_its_routing_assumption(tmp_path):
    report = memfit.estimate(_source(tmp_path, "qwen2_moe"), seq_len=16)
    assert any("balanced routing assumed" in note for note in report.notes)
