"""bench/published/published.py: the quoted rows are well-formed, and its restated losses are the same loss."""

import os
import sys

import pytest
import torch
import transformers as tf

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.published import _litgpt_8641822 as litgpt_8641822  # noqa: E402
from bench.published import published  # noqa: E402
from bench.published._rows import EXCLUDED, ROWS  # noqa: E402
import memfit  # noqa: E402
from memfit import Recipe  # noqa: E402
from memfit.estimator.truth import true_peak  # noqa: E402
from memfit.models.catalog import CATALOG  # noqa: E402
from memfit.techniques.registry import fields  # noqa: E402

# Recipe fields being built beside the bench; a row may name them before the tree has them.
PENDING = {"compile", "activation_memory_budget", "lora_targets", "lora_alpha", "lora_dropout"}


def test_rows_are_quoted_and_mapped():
    ids = [r["id"] for r in ROWS] + [r["id"] for r in EXCLUDED]
    assert len(ids) == len(set(ids))
    known = {f.name for f in fields()} | PENDING
    for row in ROWS:
        assert f"{row['value']:g}" in row["quote"].replace(",", ""), row["id"]  # the figure is the quoted one
        assert row["unit"] in published.UNITS and row["metric"] in published.FIGURE, row["id"]
        assert row["model"] in CATALOG, row["id"]
        assert set(row["recipe"]) <= known, row["id"]
        assert row["source"].startswith("https://github.com/") and len(row["commit"]) == 40, row["id"]
        assert row["note"], row["id"]
        if row.get("loss", {}).get("kind") == "torchtune":  # which recipe decides whether its loss was compiled
            assert row["loss"]["recipe"] in published.KEEPS_COMPILED_LOSS, row["id"]
    assert len(ROWS) >= 25


def test_a_recipe_that_drops_compile_loss_keeps_the_plain_loss_eager(monkeypatch):
    """full_finetune_single_device at 1814feb17 drops what compile_loss returns: its plain cross-entropy runs eager,
    the chunked one is compiled in place; the LoRA recipe keeps both."""
    from memfit.techniques import compile as compile_module

    wrapped = []
    monkeypatch.setattr(compile_module, "compiled", lambda fn: wrapped.append(fn.__name__) or fn)
    published.torchtune_loss(0, compiled=True, recipe="full_finetune_single_device")
    assert wrapped == ["_chunk_ce"]
    wrapped.clear()
    published.torchtune_loss(0, compiled=True, recipe="lora_finetune_single_device")
    assert wrapped == ["_chunk_ce", "_plain_ce"]


def _tiny():
    torch.manual_seed(0)
    config = tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                            vocab_size=96)
    model = tf.AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 96, (2, 24))
    return model, {"input_ids": ids, "labels": ids.clone()}


@pytest.mark.parametrize("loss", [published.torchtune_loss(0), published.torchtune_loss(4)],
                         ids=["torchtune-plain", "torchtune-chunked"])
def test_restated_losses_equal_the_models_own(loss):
    model, batch = _tiny()
    expected = model(**batch).loss  # mean next-token cross-entropy
    torch.testing.assert_close(loss(model, batch), expected, rtol=1e-5, atol=1e-6)


# A two-block LitGPT phi / Llama small enough for the CPU allocator (bench/published/_litgpt_8641822.py); block_size
# is the batch length: no RoPE cache rebuilt inside the step (the allocator does not see the old one freed).
_PHI = dict(padded_vocab_size=96, block_size=40, n_embd=64, n_layer=2, n_head=4, rotary_percentage=0.5,
            parallel_residual=True, shared_attention_norm=True, bias=True, lm_head_bias=True, norm_class="LayerNorm",
            norm_eps=1e-5, mlp_class="GptNeoxMLP", intermediate_size=256, gelu_approximate="tanh")
_LLAMA = dict(_PHI, rotary_percentage=1.0, parallel_residual=False, shared_attention_norm=False, bias=False,
              lm_head_bias=False, norm_class="RMSNorm", mlp_class="LLaMAMLP", intermediate_size=192)


def _lit_batch(rows=2, seq=40):
    torch.manual_seed(0)
    ids = torch.randint(0, 96, (rows, seq))
    return {"input_ids": ids, "labels": ids.clone()}


def test_litgpt_loss_is_the_mean_next_token_cross_entropy():
    torch.manual_seed(0)
    model, batch = litgpt_8641822.build(None, **_PHI), _lit_batch()
    logits = model(batch["input_ids"])[:, :-1].float()
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 96), batch["labels"][:, 1:].reshape(-1))
    torch.testing.assert_close(published.litgpt_loss(7)(model, batch), expected, rtol=1e-5, atol=1e-6)


def test_litgpt_qkv_lora_adapts_q_and_v_only():
    torch.manual_seed(0)
    layer = litgpt_8641822.build(None, **_LLAMA).transformer.h[0].attn.attn
    torch.nn.init.normal_(layer.lora_B)
    x = torch.randn(2, 5, 64)
    a_q, a_v = layer.lora_A.chunk(2)
    b_q, b_v = layer.lora_B.split(64)
    zero = torch.zeros(2, 5, 64)
    expected = layer.linear(x) + 2.0 * torch.cat([x @ a_q.T @ b_q.T, zero, x @ a_v.T @ b_v.T], dim=-1)
    torch.testing.assert_close(layer.eval()(x), expected)  # alpha 16 / r 8 = 2; eval: no dropout


@pytest.mark.parametrize("config, quantize", [(_PHI, None), (_LLAMA, None), (_PHI, "bnb.nf4-dq"),
                                              (_LLAMA, "bnb.nf4-dq")], ids=["phi", "llama", "phi-nf4", "llama-nf4"])
def test_litgpt_estimate_matches_the_allocator(config, quantize):
    """LitGPT's fused-qkv LoRA, its RMSNorm and RoPE, and bitsandbytes 0.41's 4-bit layers (every linear,
    the head too, each keeping its input): memfit's estimate is what the CPU allocator measures."""
    factory = lambda: litgpt_8641822.build(None, quantize, **config)  # noqa: E731
    recipe = Recipe(precision="bf16")
    batch = _lit_batch()
    report = memfit.estimate(factory, batch, loss_fn=published.litgpt_loss(16), recipe=recipe)
    truth = true_peak(factory, batch, loss_fn=published.litgpt_loss(16), recipe=recipe)
    assert abs(report.peak_bytes - truth) <= 4 * 2 * 2 + 16, (report.peak_bytes, truth)  # AdamW's step counters
    assert report.trainable == 2 * (16 * 64 + 128 * 8)  # lora_A (2r x d) and lora_B (q + v widths x r) per block


def test_a_replayed_torchao_step_adds_the_measured_update_buffer():
    """bench/published/torchao_step.py: under torch 2.5.1 + torchao 0.6.1 the compiled 8-bit step holds an fp32 buffer
    of the parameter's shape beside the two moments (measured, in bench/results/torchao-step-cpu.json); replaying it
    raises the step's peak by 4 bytes a value of the largest quantised parameter."""
    pytest.importorskip("torchao")
    from bench.published.torchao_step import measured, replayed

    assert measured("torch 2.5.1, torchao 0.6.1")["peak_bytes_per_value"] == pytest.approx(12, abs=0.05)
    assert measured("torch 2.13.0, torchao 0.18.0")["peak_bytes_per_value"] == pytest.approx(8, abs=0.05)

    def factory():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 256, bias=False), torch.nn.Linear(256, 512, bias=False))

    batch = {"x": torch.randn(8, 64)}
    loss = lambda model, b: model(b["x"]).square().mean()  # noqa: E731
    recipe = memfit.Recipe(optimizer="ao_adamw8bit")
    today = memfit.estimate(factory, batch, loss_fn=loss, recipe=recipe)
    with replayed("torch 2.5.1, torchao 0.6.1"):
        then = memfit.estimate(factory, batch, loss_fn=loss, recipe=recipe)
    assert then.phase_peaks["optimizer"] - today.phase_peaks["optimizer"] == 4 * 256 * 512


# torchtune's decoder restated (bench/published/_torchtune_1814feb.py), two layers, small enough for the allocator:
# the one gpu_check --smoke runs
_TT_TINY = published._SMOKE_TORCHTUNE


def _tt_model(tied: bool):
    from bench.published import _torchtune_1814feb as torchtune_1814feb

    torch.manual_seed(0)
    return torchtune_1814feb.TransformerDecoder(**_TT_TINY, tied=tied)


def test_torchtune_decoder_rotates_and_attends_as_torchtune():
    """Its RoPE is Llama 3.1's scaled table applied pairwise in fp32 at each token's input_pos, its GQA copies k and v
    to every head: checked against an independent computation of one layer's attention."""
    model = _tt_model(tied=True)
    attn = model.layers[0].attn
    model.rope._build(torch.device("cpu"))  # the decoder builds its RoPE table at its first forward
    x = torch.randn(1, 6, 64)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])  # two packed documents

    def rope(t):  # t: (b, s, h, d); rotate each (even, odd) pair by position x frequency
        freqs = torch.tensor(attn.pos_embeddings.scaled)
        angle = pos[..., None].float() * freqs  # (b, s, d/2)
        cos, sin = angle.cos()[:, :, None], angle.sin()[:, :, None]
        even, odd = t[..., 0::2].float(), t[..., 1::2].float()
        return torch.stack([even * cos - odd * sin, odd * cos + even * sin], -1).flatten(3)

    q = rope(attn.q_proj(x).view(1, 6, 4, 16)).transpose(1, 2)
    k = rope(attn.k_proj(x).view(1, 6, 2, 16)).transpose(1, 2).repeat_interleave(2, dim=1)
    v = attn.v_proj(x).view(1, 6, 2, 16).transpose(1, 2).repeat_interleave(2, dim=1)
    expected = attn.output_proj(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                                .transpose(1, 2).reshape(1, 6, 64))
    torch.testing.assert_close(attn(x, input_pos=pos), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunks, tied", [(0, True), (4, False)], ids=["plain-tied", "chunked-untied"])
def test_torchtune_decoder_estimate_matches_the_allocator(chunks, tied):
    """memfit's trace of torchtune's decoder and the bench's torchtune loss, against the CPU allocator (bf16,
    block checkpointing, optimizer in backward, as the table's full fine-tunes)."""
    from bench.published import _torchtune_1814feb as torchtune_1814feb

    batch = torchtune_1814feb.batch(2, 32, vocab=4096)
    loss = published.torchtune_loss(chunks, recipe="full_finetune_single_device")
    recipe = Recipe(precision="bf16", checkpointing="blocks", optimizer_in_backward=True)
    report = memfit.estimate(lambda: _tt_model(tied), batch(), loss_fn=loss, recipe=recipe)
    assert report.peak_bytes == true_peak(lambda: _tt_model(tied), batch(), loss_fn=loss, recipe=recipe)


@pytest.mark.parametrize("chunks", [0, 4])
def test_the_sharded_rows_loss_runs_the_decoders_forward(chunks):
    """The FSDP2 rows' loss takes the head's chunks from the decoder's forward (where the root unit's all-gather
    hook runs): the same value as the loss that applies the head itself."""
    from bench.published import _torchtune_1814feb as torchtune_1814feb

    model, batch = _tt_model(tied=False), torchtune_1814feb.batch(2, 32, vocab=4096)()
    expected = published.torchtune_loss(chunks)(model, batch)
    torch.testing.assert_close(published.torchtune_loss(chunks, sharded=True)(model, batch), expected)
