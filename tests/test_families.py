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


# Lengths other than 32, graded here rather than estimated once more in a test of their own:
# - Mamba at a longer sequence: the fake trace collapses the per-token scan (models/mamba_scan.py), the real run
#   loops over every token (was test_collapsed_mamba_scan_matches_the_real_loop_at_a_longer_sequence);
# - rotary and state-space models have no position limit: Mixtral's max_position_embeddings=128 is a training
#   length, not a table size, and Mamba-2 has none (was test_rotary_and_state_space_models_have_no_position_limit,
#   which only asked for a peak above 0); ``make_batch`` is where a length past a position table is refused.
SEQ = {"mamba": 128, "mixtral": 256, "mamba2": 160}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """``graded(family, precision)``: (estimate, allocator truth) of the family at its SEQ, once a module."""
    made = {}

    def get(family, precision):
        if (family, precision) not in made:
            made[family, precision] = _graded(_source(tmp_path_factory.mktemp(family), family), precision,
                                              SEQ.get(family, 32))
        return made[family, precision]

    return get


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_family_matches_allocator(graded, family, precision):
    report, truth = graded(family, precision)
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


DEEP = [("mamba", ["num_hidden_layers"]), ("mamba2", ["num_hidden_layers"]), ("mixtral", ["num_hidden_layers"]),
        ("whisper", ["encoder_layers", "decoder_layers"])]
# The fewest blocks a 4-block copy (first, second, middle, last) is shallower than: the middle block is written
# out twice. fast=True engages the fast path below FAST_MIN_DEPTH (tests/test_depth.py checks it engages by
# itself from there).
DEPTH = 5


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """``deep(family)``: the family at DEPTH blocks, estimated once each way and kept for both tests below:
    (the fast estimate, the ledger of the copy it traced, the full trace's report, its ledger). The copy's
    ledger is the one the estimate wrote out (caught on its way out of ``depth.fake_trace``); the full trace
    is what ``estimate(fast=False)`` runs, with the ledger kept."""
    from unittest import mock

    from memfit.estimator import depth
    from memfit.estimator.fake_trace import fake_trace
    from memfit.techniques.recipe import recipe_from

    made = {}

    def get(family):
        if family not in made:
            keys = dict(DEEP)[family]
            path = tmp_path_factory.mktemp(family) / "config.json"
            path.write_text(json.dumps({**CONFIGS[family], **{key: DEPTH for key in keys}}))
            copies = []

            def caught(*args, **kwargs):
                copies.append(fake_trace(*args, **kwargs))
                return copies[-1]

            with mock.patch.object(depth, "fake_trace", caught):
                fast = memfit.estimate(str(path), seq_len=8, fast=True)
            recipe, factory = recipe_from(memfit.Recipe(), "fp32", "adamw")
            full, result = fake_trace(resolve(str(path)), None, recipe=recipe, loss_fn=None, optimizer=factory,
                                      steps=2, batch_size=1, seq_len=8, keep=True)
            assert len(copies) == 1  # the 4-block copy, nothing else
            made[family] = fast, copies[0][1].ledger, full, result.ledger
        return made[family]

    return get


@pytest.mark.parametrize("family", dict(DEEP))
def test_depth_fast_path_agrees_with_full_trace(deep, family):
    fast, _, full, _ = deep(family)
    assert fast.method == "depth" and full.method == "fake"
    assert fast.settings["traced_depths"] == [4] and fast.settings["depth"] == DEPTH
    assert fast.peak_bytes == full.peak_bytes


@pytest.mark.parametrize("family", dict(DEEP))
def test_written_log_is_the_full_trace_log_on_cpu(deep, family):
    """Event for event (kernel scratch sites aside: they keep the shallow copy's). Mamba's conv
    fallback calls a fresh activation module that is no submodule of the model, and CPU AdamW
    loops over parameters (``foreach=False``), freeing a block's last temporary in the next block."""
    from memfit.accounting.ledger import ALLOC, FREE, SPIKE
    from memfit.accounting.synth import synthesise

    _, copy, _, full = deep(family)

    def events(ledger):
        return [(kind, ledger.records[i].nbytes, ledger.records[i].category, ledger.records[i].module)
                if kind in (ALLOC, FREE) else (kind, None if kind == SPIKE else i) for kind, i in ledger.events]
    log = synthesise(copy, depth=DEPTH)
    assert log.unmatched == 0
    assert events(log) == events(full)


# Parameter counts published on the model cards (whisper-small's card rounds 241.7M to 244M), against the
# catalog's stored counts: configs/_counts.json, which tests/test_catalog.py checks against fresh meta builds
# and against an estimate's report.parameters (it used to be a whole estimate of each model here).
PUBLISHED = {"mixtral-8x7b": 46.7e9, "qwen1.5-moe-a2.7b": 14.3e9, "qwen3-30b-a3b": 30.5e9,
             "whisper-large-v3": 1.55e9, "llava-1.5-7b": 7.06e9, "mamba-130m": 0.129e9}


def test_new_catalog_entries_match_published_sizes():
    from memfit.models import counts

    for name, published in PUBLISHED.items():
        assert name in CATALOG
        assert abs(counts.table()[name].params - published) / published < 0.01, name


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


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    """The mixtral build and batch, and ``truth(routing, precision)``: the allocator's peak with the router
    forced, each measured once for both tests below."""
    path = tmp_path_factory.mktemp("mixtral") / "config.json"
    path.write_text(json.dumps(CONFIGS["mixtral"]))
    source = resolve(str(path))
    batch = source.make_batch(2, 32)
    truths = {}

    def truth(routing, precision):
        if (routing, precision) not in truths:
            truths[routing, precision] = true_peak(_forced_router(source.build, routing), batch, precision=precision)
        return truths[routing, precision]

    return source.build, batch, truth


@pytest.mark.parametrize("routing", ["balanced", "worst"])
def test_moe_routing_matches_the_forced_real_routing_in_bf16(routed, routing):
    # Pure bf16 is where routing shows: the CPU grouped_mm converts each expert's rows to fp32.
    build, batch, truth = routed
    report = memfit.estimate(_forced_router(build, routing), batch, precision="bf16", moe_routing=routing)
    assert abs(report.peak_bytes - truth(routing, "bf16")) / truth(routing, "bf16") < TOLERANCE, (
        report.peak_bytes, truth(routing, "bf16"))


def test_moe_routing_changes_only_bf16_kernel_scratch(routed):
    build, batch, truth = routed
    assert truth("balanced", "fp32") == truth("worst", "fp32")  # every expert tensor is tokens x top_k
    # where the CPU converts bf16 expert rows to fp32 the worst routing needs more scratch; on a CPU
    # with native bf16 matmuls (AMX, AVX512-BF16: no conversion) the two are equal
    assert truth("worst", "bf16") >= truth("balanced", "bf16")
    with pytest.raises(MemfitError, match="balanced, worst"):
        memfit.estimate(build, batch, moe_routing="uniform")


def test_a_vision_language_model_without_a_batch_recipe_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="qwen2_vl", architectures=["Qwen2VLForConditionalGeneration"],
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4))))
    with pytest.raises(MemfitError, match="cannot make a batch for qwen2_vl.*batch=") as err:
        memfit.estimate(str(tmp_path / "config.json"), seq_len=32)
    assert "\n" not in str(err.value)


def test_moe_reports_its_routing_assumption(graded):
    report, _ = graded("qwen2_moe", "fp32")  # the note is the trace's, whatever the model was given as
    assert any("balanced routing assumed" in note for note in report.notes)
