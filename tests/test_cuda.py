"""CUDA semantics on a CPU-only machine: each modelled difference, and the recorded H100 runs."""

import json
import os

import pytest
import torch
import transformers as tf

import memfit
from memfit import Recipe
from memfit.cuda import cuda_attention_kernel, cuda_semantics
from memfit.gpus import gpu
from memfit.models.zoo import CASES

RESULTS = os.path.join(os.path.dirname(__file__), "..", "bench", "results")


def _llama(heads=4, kv_heads=2):
    cfg = tf.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, vocab_size=1024, max_position_embeddings=256)
    return tf.LlamaForCausalLM(cfg)


def _tokens(rows=2, seq=128):
    ids = torch.randint(0, 1024, (rows, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def _dtypes():
    x = torch.randn(4, 16)
    lin, norm = torch.nn.Linear(16, 16), torch.nn.LayerNorm(16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = lin(x)
        return h.dtype, norm(h).dtype, torch.softmax(h, -1).dtype, h.sum().dtype, torch.exp(h).dtype


def test_autocast_follows_cuda_lists_only_inside_and_is_removed_after():
    cpu = _dtypes()
    assert cpu == (torch.bfloat16,) * 5  # CPU autocast leaves these in bf16
    with cuda_semantics():
        cuda = _dtypes()
    # torch's CUDA lists: linear lower precision; layer_norm, exp fp32; softmax, sum fp32 (set_opt_dtype)
    assert cuda == (torch.bfloat16, torch.float32, torch.float32, torch.float32, torch.float32)
    assert _dtypes() == cpu


@pytest.mark.parametrize("dtype,mask,kv_heads,kernel", [
    (torch.bfloat16, None, 2, "flash"),      # GQA in 16 bits: flash
    (torch.float32, None, 4, "efficient"),   # fp32: memory-efficient
    (torch.float32, None, 2, "math"),        # fp32 grouped-query: no fused kernel
    (torch.bfloat16, "mask", 4, "efficient"),  # an explicit mask rules out flash
])
def test_attention_kernel_choice(dtype, mask, kv_heads, kernel):
    q = torch.empty(1, 4, 32, 64, dtype=dtype)
    k = torch.empty(1, kv_heads, 32, 64, dtype=dtype)
    attn_mask = torch.ones(32, 32, dtype=torch.bool) if mask else None
    assert cuda_attention_kernel(q, k, attn_mask, enable_gqa=kv_heads != 4) == kernel


def test_fp32_gqa_keeps_the_attention_matrix_on_cuda_only():
    batch = _tokens()
    on_cpu = memfit.estimate(_llama, batch)
    on_cuda = memfit.estimate(_llama, batch, device="cuda")
    bf16 = memfit.estimate(_llama, batch, device="cuda", precision="bf16-mixed")
    assert not any("S x S" in n for n in on_cpu.notes)
    assert any("S x S" in n and "grouped-query" in n for n in on_cuda.notes)
    assert not any("S x S" in n for n in bf16.notes)
    # 2 layers x 2 rows x 4 heads x 128 x 128 fp32 weights saved for backward, at least
    assert on_cuda.by_category["activations"] - on_cpu.by_category["activations"] >= 2 * 2 * 4 * 128 * 128 * 4


def test_cuda_optimizer_is_foreach_and_its_temporaries_show():
    batch = _tokens(rows=1, seq=16)
    cpu = memfit.estimate(_llama, batch)
    cuda = memfit.estimate(_llama, batch, device="cuda")
    params = 4 * sum(p.numel() for p in _llama().parameters())
    # foreach AdamW keeps whole-model temporaries (sqrt of the second moment) during the step
    extra = cuda.phase_peaks["optimizer"] - cpu.phase_peaks["optimizer"]
    assert extra > 0.9 * params, (extra, params)


def test_workspaces_rounding_reserved_and_context():
    batch = _tokens(rows=1, seq=16)
    card = gpu("rtx-4090")
    report = memfit.estimate(_llama, batch, gpu=card)
    spaces = [(m, b) for m, b in report.modules if "cuBLAS" in m]
    assert sorted(spaces) == [("(cuBLAS workspace, backward thread)", card.cublas_workspace_bytes),
                              ("(cuBLAS workspace, forward thread)", card.cublas_workspace_bytes)]
    assert card.cublas_workspace_bytes == 8_519_680  # ":4096:2:16:8" below Hopper
    assert report.device == "cuda" and report.gpu == "rtx-4090"
    assert report.peak_bytes % 512 == 0 and report.reserved_bytes >= report.peak_bytes
    assert report.reserved_bytes % (2 * 1024 * 1024) == 0  # whole segments
    assert report.device_bytes == report.reserved_bytes + card.cuda_context_bytes
    assert memfit.estimate(_llama, batch).reserved_bytes is None


def test_depth_path_matches_the_full_trace_on_cuda():
    cfg = tf.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1024, max_position_embeddings=256)
    fast = memfit.estimate(cfg, seq_len=128, batch_size=2, device="cuda", precision="bf16-mixed", fast=True)
    full = memfit.estimate(cfg, seq_len=128, batch_size=2, device="cuda", precision="bf16-mixed", fast=False)
    assert abs(fast.peak_bytes - full.peak_bytes) / full.peak_bytes < 0.01
    assert abs(fast.reserved_bytes - full.reserved_bytes) / full.reserved_bytes < 0.05


# Recorded on an H100 80GB HBM3 (torch 2.11.0+cu130) by `python bench/cuda_gap.py measure`;
# the estimates here are made now, on this CPU. Cases whose gap is understood and modelled.
RECORDED = ["gpt/fp32/adamw", "gpt/bf16-mixed/adamw", "hf-llama/fp32/adamw", "hf-llama/bf16-mixed/sgd",
            "hf-gpt2/bf16-mixed/adamw", "hf-bert/fp32/adamw", "encoder/fp32/adamw", "mlp/bf16-mixed/adamw"]


@pytest.mark.parametrize("case", RECORDED)
def test_estimate_without_a_gpu_matches_recorded_h100_runs(case):
    with open(os.path.join(RESULTS, "cuda-gap-h100.json")) as f:
        real = json.load(f)["cases"][case]
    name, precision, optimizer = case.split("/")
    build, batch, loss = CASES[name]
    est = memfit.estimate(build, batch(), loss_fn=loss, precision=precision, optimizer=optimizer, gpu="h100-sxm")
    assert abs(est.peak_bytes - real["allocated_peak"]) / real["allocated_peak"] < 0.03
    assert abs(est.reserved_bytes - real["reserved_peak"]) / real["reserved_peak"] < 0.08
    # the CPU-semantics estimate of the same step misses the GPU by far more (no workspaces)
    cpu = memfit.estimate(build, batch(), loss_fn=loss, precision=precision, optimizer=optimizer)
    assert abs(cpu.peak_bytes - real["allocated_peak"]) > 3 * abs(est.peak_bytes - real["allocated_peak"])
