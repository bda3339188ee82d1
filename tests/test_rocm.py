"""AMD cards and ROCm semantics (hardware/amd.py): the catalog's figures as sourced, the BLAS workspaces ROCm's torch
allocates (hipBLASLt's for matrix products, hipBLAS's only for vector ones; research/rocm/blas_paths.md), RDNA3's
math attention, and a ROCm out-of-memory message read by doctor. Never run on an AMD card."""

import pytest
import torch
import transformers as tf

import memfit
from memfit.accounting.events import ALLOC
from memfit.hardware.amd import EXPERIMENTAL_ENV
from memfit.hardware.gpus import CATALOG, gpu, peer_link
from memfit.profiling.doctor import diagnose
from memfit.profiling.oom_text import parse_oom

MiB = 2**20


def _llama():
    cfg = tf.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=1024, max_position_embeddings=256)
    return tf.LlamaForCausalLM(cfg)


def _tokens(rows=2, seq=128):
    ids = torch.randint(0, 1024, (rows, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def test_the_amd_cards_by_their_torch_names_with_rocminfo_memory():
    mi300x = gpu("AMD Instinct MI300X")
    assert mi300x.name == "mi300x" and mi300x.semantics == "ROCm" and mi300x.arch == "gfx942"
    assert mi300x.memory_bytes == 201_310_208 * 1024  # rocminfo's pool: 192 GiB less 16 MiB
    assert gpu("AMD Instinct MI250X/MI250").memory_bytes == 67_092_480 * 1024  # one GCD
    assert gpu("AMD Radeon RX 7900 XTX").memory_bytes == 25_149_440 * 1024
    assert gpu("AMD Radeon PRO W7900").name == "w7900"
    assert mi300x.bf16 and mi300x.fp8 and not gpu("mi250x").fp8 and not gpu("7900xtx").fp8
    assert mi300x.bf16_flops == 1307.4e12 and mi300x.memory_bandwidth == 5.3e12  # mi300.md's peak table
    assert peer_link(mi300x) == ("Infinity Fabric", 448e9) and peer_link(gpu("w7900"))[0] == "PCIe 4.0 x16"
    for name in ("mi250x", "mi300x", "mi325x", "mi355x", "rx-7900-xtx", "w7900"):
        assert CATALOG[name].source and CATALOG[name].vendor == "amd"


def test_hipblaslt_workspaces_per_thread_and_hipblas_only_for_vector_products():
    """CublasHandlePool.cpp: hipBLASLt 76 MiB for every card; hipBLAS 128 MiB on gfx94x/95x, 32 MiB elsewhere."""
    assert gpu("mi300x").blas_workspaces == (("hipBLASLt", 76 * MiB), ("hipBLAS", 128 * MiB))
    assert gpu("mi250x").blas_workspaces == (("hipBLASLt", 76 * MiB), ("hipBLAS", 32 * MiB))
    report = memfit.estimate(_llama(), _tokens(), gpu="mi300x", precision="bf16-mixed")
    spaces = sorted((m, b) for m, b in report.modules if "workspace" in m)
    assert spaces == [("(hipBLASLt workspace, backward thread)", 76 * MiB),
                      ("(hipBLASLt workspace, forward thread)", 76 * MiB)]
    on_h100 = memfit.estimate(_llama(), _tokens(), gpu="h100-sxm", precision="bf16-mixed")
    # the same step: what differs is the two workspaces (76 MiB each, not cuBLAS's 32 MiB) and nothing else
    assert report.peak_bytes - on_h100.peak_bytes == 2 * (76 - 32) * MiB

    class Mv(torch.nn.Module):  # an fp32 matrix-vector product: hipBLAS's own handle and workspace
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(64, 64))

        def forward(self, x):
            return torch.mv(self.w, x).sum()

    mv = memfit.estimate(Mv(), torch.randn(64), gpu="mi300x", loss_fn=lambda model, batch: model(batch))
    assert ("(hipBLAS workspace, forward thread)", 128 * MiB) in mv.modules


def test_rdna3_runs_math_attention_unless_the_experimental_switch_is_set(monkeypatch):
    """AOTriton >= 0.11 calls gfx1100 experimental: SDPA falls back to the math path and keeps S x S weights."""
    batch = _tokens(rows=1, seq=256)
    kwargs = dict(precision="bf16-mixed")
    monkeypatch.delenv(EXPERIMENTAL_ENV, raising=False)
    radeon = memfit.estimate(_llama(), batch, gpu="rx-7900-xtx", **kwargs)
    mi300x = memfit.estimate(_llama(), batch, gpu="mi300x", **kwargs)
    assert radeon.notes and "no fused attention kernel" in " ".join(radeon.notes)
    assert radeon.peak_bytes > mi300x.peak_bytes + 4 * 256 * 256 * 2  # at least one layer's bf16 weights kept
    monkeypatch.setenv(EXPERIMENTAL_ENV, "1")
    switched = memfit.estimate(_llama(), batch, gpu="rx-7900-xtx", **kwargs)
    assert switched.peak_bytes < radeon.peak_bytes and not any("S x S" in n for n in switched.notes)


def test_the_first_line_names_rocm_semantics_and_outside_is_assumed():
    report = memfit.estimate(_llama(), _tokens(), gpu="mi300x")
    from memfit.report.report import target_line

    assert target_line(report).startswith("on the mi300x (ROCm semantics:")
    outside = report.outside
    names = [t["name"] for t in outside["terms"]]
    assert names[:2] == ["HIP context", "rocBLAS/hipBLASLt"]
    assert not any(t["measured"] for t in outside["terms"])  # nothing was measured on an AMD card


HIP = ("torch.OutOfMemoryError: HIP out of memory. Tried to allocate 432.00 MiB. GPU 0 has a total capacity of "
       "15.92 GiB of which 7.12 GiB is free. Of the allocated memory 8.08 GiB is allocated by PyTorch, and 321.96 MiB "
       "is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
       "PYTORCH_HIP_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
       "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")


def test_a_rocm_message_is_read_as_cudas():
    """Comfy-Org/ComfyUI#9529 (2025-08-24): the hipified wording; no per-process line on ROCm."""
    m = parse_oom(HIP)
    assert m.requested == 432 * MiB and m.capacity == round(15.92 * 2**30)
    assert m.allocated == round(8.08 * 2**30) and m.reserved_unallocated == round(321.96 * MiB)
    assert "7.12 GiB free" in diagnose(HIP).summary  # free memory it could not use: the message alone cannot say why
    # ROCm/TheRock#1054 (gfx1151): a request larger than the whole card
    whole = ("torch.OutOfMemoryError: HIP out of memory. Tried to allocate 16.00 GiB. GPU 0 has a total capacity of "
             "15.24 GiB of which 15.09 GiB is free. Of the allocated memory 0 bytes is allocated by PyTorch, and 0 bytes "
             "is reserved by PyTorch but unallocated.")
    assert parse_oom(whole).requested == 16 * 2**30
    assert "16.00 GiB request alone is more than the whole 15.24 GiB card" in diagnose(whole).summary
