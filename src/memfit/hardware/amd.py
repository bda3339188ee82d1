"""AMD Instinct and Radeon cards, and where ROCm's PyTorch allocates differently from CUDA's.

What ROCm's torch does (``research/rocm/notes.md`` cites every fact: repository, path, commit, function):

* **The allocator is CUDA's.** ROCm builds hipify ``c10/cuda/CUDACachingAllocator.cpp``; its block sizes and
  rounding (512 B, 1 MiB small / 2 MiB small segments, 20 MiB large segments, 2 MiB rounding) carry no ``USE_ROCM``
  branch, so ``accounting/cuda_allocator.py`` replays a ROCm step unchanged. ``PYTORCH_CUDA_ALLOC_CONF`` is read
  first on ROCm too (then ``PYTORCH_HIP_ALLOC_CONF``, then ``PYTORCH_ALLOC_CONF``; only one is parsed).
  Expandable segments exist on ROCm from torch 2.12 built on ROCm >= 7.0 (pytorch#177974, #179930; AMD's own 2.11
  builds backport it); upstream 2.11 and older ignore the setting with a warning.
* **hipBLASLt's workspace, not cuBLAS's.** A hipBLAS handle does not hold a hipBLASLt one ("Note [hipblaslt
  handles]", ``CublasHandlePool.cpp``), so CUDA's unified workspace does not exist here: hipBLASLt, the preferred
  backend on every card here (``getHipblasltPreferredArchs``), takes ``parseCUDABlasLtWorkspaceSize()``'s 76 MiB
  ("Use 76 MB for hipBLASLt") from the caching allocator per (handle, stream) at a thread's first matmul, and its
  path (``bgemm_internal_cublaslt``, ``gemm_and_bias``) never asks for the hipBLAS handle. hipBLAS (rocBLAS) gets its
  own, ``parseChosenWorkspaceSize()``'s 128 MiB on gfx94x/gfx95x and 32 MiB elsewhere, only for what hipBLASLt does
  not run: ``mv``/``addmv``/``dot``/``vdot``, fp64 and complex matmuls, and hipBLASLt's failure fallback
  (``research/rocm/blas_paths.md``: CUDABlas.cpp @bd53dc4, CublasHandlePool.cpp @26a3905). After 2.13 main moves
  gfx942's hipBLAS to 32 MiB and hipBLASLt to 80 MiB (pytorch#197201): not modelled, this is 2.11-2.13.
* **Attention.** SDPA's flash and memory-efficient backends are both AOTriton's; its forward keeps the logsumexp
  fp32 [B, H, Sq] unpadded and the output, as the kernels ``hardware/cuda.py`` traces. On RDNA3 (gfx1100: the
  RX 7900 XTX, W7900) AOTriton >= 0.11 (torch 2.9 onward) calls the arch experimental and SDPA falls back to the math
  path (the S x S weights kept for backward) unless ``TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1`` is set where
  memfit runs, as it would be where the job runs.
* **Outside the allocator.** No measured HIP context, rocBLAS/hipBLASLt library or RCCL figure was found for any
  card: ``hardware/outside.py`` counts the H200's measured figures for them, marked assumed.

Left out: the philox seed and offset AOTriton's flash forward keeps on the GPU (two 512-byte blocks a call), CK's
attention (``TORCH_ROCM_FA_PREFER_CK``), hipBLASLt's workspace under ``HIPBLASLT_WORKSPACE_SIZE`` /
``CUBLAS_WORKSPACE_CONFIG`` overrides, MI300A (an APU). Never run on an AMD card: every rule is read from the
source, and no published allocator measurement on an Instinct card was found to check one against.
"""

from __future__ import annotations

import os

from memfit.hardware.card import GPU

__all__ = ["AMD", "AMD_ALIASES", "AMD_PEER_LINKS", "EXPERIMENTAL_ENV"]

MiB, KiB = 1024**2, 1024
GB_S, TFLOPS = 1e9, 1e12
_PCIE4, _PCIE5 = 32 * GB_S, 64 * GB_S  # per direction (gpus.py)
EXPERIMENTAL_ENV = "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL"

# CublasHandlePool.cpp (cyyever/pytorch @f4147182, 2026): parseChosenWorkspaceSize() on ROCm
# `isGPUArch({"gfx94", "gfx95"}) ? 1024 * 128 * 1024 : 1024 * 32 * 1024`; parseCUDABlasLtWorkspaceSize() `76 * 1024` KiB
_HIPBLAS_CDNA3, _HIPBLAS, _HIPBLASLT = 128 * MiB, 32 * MiB, 76 * MiB
# No HIP context was measured on any card (notes §5): the typical CUDA figure (gpus.py), assumed
_HIP_CONTEXT = 512 * MiB


def _rocm(name, full_name, pool_kib, arch, cc, bw_gb_s, link, link_bw, bf16_tf, fp32_tf, matrix_fp32_tf, *,
          fp8: bool, source: str, fused_attention: bool = True) -> GPU:
    hipblas = _HIPBLAS_CDNA3 if arch.startswith(("gfx94", "gfx95")) else _HIPBLAS
    return GPU(name=name, full_name=full_name, memory_bytes=pool_kib * KiB, compute_capability=cc,
               memory_bandwidth=bw_gb_s * GB_S, host_link=link, host_link_bandwidth=link_bw,
               bf16_flops=bf16_tf * TFLOPS, fp16_flops=bf16_tf * TFLOPS, fp32_flops=fp32_tf * TFLOPS,
               tf32_flops=matrix_fp32_tf * TFLOPS, cuda_context_bytes=_HIP_CONTEXT,
               cublas_workspace_bytes=_HIPBLASLT, bf16=True, fp8=fp8, vendor="amd", arch=arch,
               workspaces=(("hipBLASLt", _HIPBLASLT), ("hipBLAS", hipblas)), fused_attention=fused_attention,
               source=source)


# Memory: ``hipDeviceProp.totalGlobalMem`` is the card's local pool as ``rocminfo`` lists it ("Pool 1 ... COARSE
# GRAINED Size: N KB"); the published logs show the nominal size less 16 MiB: MI300X 201310208 KB (ROCm/vllm#397,
# ROCm/aiter#3807), MI250X's GCD 67092480 KB, RX 7900 XTX 25149440 KB (many rocminfo dumps in public issues). The
# MI325X, MI355X and W7900 follow the same rule, not seen in a log. Compute and links: ROCm docs "AMD GPU
# specifications" (ROCm/rocm-docs docs/reference/gpu-specs.rst @2b48ffc7) for VRAM and CUs; the MI300 and MI250
# microarchitecture pages (ROCm/legacy-rocm-build docs/conceptual/gpu-arch/mi300.md, mi250.md @089d7513) for peaks.
AMD: dict[str, GPU] = {
    # MI250X: one GCD is one torch device (64 GiB, 1.6 TB/s, its own PCIe Gen4 x16). Peaks per OAM from AMD's launch
    # table as third parties quote it (BF16 383, FP32 vector 47.9, matrix 95.7), halved per GCD. CDNA2: no FP8.
    "mi250x": _rocm("mi250x", "AMD Instinct MI250X (one GCD)", 67_092_480, "gfx90a", (9, 0), 1600, "PCIe 4.0 x16",
                    _PCIE4, 191.5, 23.95, 47.85, fp8=False,
                    source="ROCm docs gpu-specs and MI250 microarchitecture; rocminfo 67092480 KB per GCD"),
    # MI300X: mi300.md "Peak-performance capabilities": BF16/FP16 1307.4, FP32 vector 163.4, TF32 653.7, FP8 2614.9;
    # 5.3 TB/s; PCIe Gen5 x16 to the host.
    "mi300x": _rocm("mi300x", "AMD Instinct MI300X", 201_310_208, "gfx942", (9, 4), 5300, "PCIe 5.0 x16", _PCIE5,
                    1307.4, 163.4, 653.7, fp8=True,
                    source="ROCm docs MI300 microarchitecture (peaks, 5.3 TB/s); rocminfo 201310208 KB"),
    # MI325X: the MI300X's die with 256 GB HBM3E at 6.0 TB/s (Vultr's copy of AMD's product page: FP16 1307).
    "mi325x": _rocm("mi325x", "AMD Instinct MI325X", 256 * 1024 * 1024 - 16 * 1024, "gfx942", (9, 4), 6000,
                    "PCIe 5.0 x16", _PCIE5, 1307.4, 163.4, 653.7, fp8=True,
                    source="ROCm docs gpu-specs (256 GiB); AMD product page as Vultr quotes it; memory by rule"),
    # MI355X: CDNA4, 288 GB HBM3E at 8 TB/s (The Register, 2025-06-12); BF16 dense ~2.5 PF derived from the press's
    # FP8 ~5 PF (unverified); FP32 vector 157.3 (AMD's launch table as quoted; unverified). No TF32 units: FP32 rate.
    "mi355x": _rocm("mi355x", "AMD Instinct MI355X", 288 * 1024 * 1024 - 16 * 1024, "gfx950", (9, 5), 8000,
                    "PCIe 5.0 x16", _PCIE5, 2500, 157.3, 157.3, fp8=True,
                    source="ROCm docs gpu-specs (288 GiB); press figures (unverified); memory by rule"),
    # RDNA3 (gfx1100): AOTriton's attention is experimental there (module docstring). Peaks from AMD's product pages
    # as remembered, not read in a session (unverified): 7900 XTX 960 GB/s, FP16/BF16 WMMA 122.8, FP32 61.4;
    # W7900 864 GB/s, 122.6, 61.3. No FP8.
    "rx-7900-xtx": _rocm("rx-7900-xtx", "AMD Radeon RX 7900 XTX", 25_149_440, "gfx1100", (11, 0), 960,
                         "PCIe 4.0 x16", _PCIE4, 122.8, 61.4, 61.4, fp8=False, fused_attention=False,
                         source="ROCm docs gpu-specs (24 GiB); rocminfo 25149440 KB; peaks unverified"),
    "w7900": _rocm("w7900", "AMD Radeon PRO W7900", 48 * 1024 * 1024 - 16 * 1024, "gfx1100", (11, 0), 864,
                   "PCIe 4.0 x16", _PCIE4, 122.6, 61.3, 61.3, fp8=False, fused_attention=False,
                   source="ROCm docs gpu-specs (48 GiB); memory by rule; peaks unverified"),
}

#: other spellings, compared as gpus.py compares them (vendor words dropped: "AMD Instinct MI300X" is "mi300x")
AMD_ALIASES = {"mi250xmi250": "mi250x", "mi250": "mi250x", "7900xtx": "rx-7900-xtx", "rx7900xtx": "rx-7900-xtx",
               "prow7900": "w7900", "mi300": "mi300x", "mi325": "mi325x", "mi355": "mi355x"}

# Peer links per direction: an MI300-series node joins 8 GPUs fully with 7 Infinity Fabric links each (mi300.md);
# 896 GB/s aggregate (a third-party figure) halved. An MI250X GCD: its sibling over 4 links (200 GB/s a direction,
# mi250.md) and the others over fewer: 100 GB/s assumed. Radeons exchange over PCIe.
AMD_PEER_LINKS = {"mi300x": ("Infinity Fabric", 448e9), "mi325x": ("Infinity Fabric", 448e9),
                  "mi355x": ("Infinity Fabric", 448e9), "mi250x": ("Infinity Fabric", 100e9)}


def fused_attention(card: GPU) -> bool:
    """Whether SDPA on ``card`` runs a fused (flash / memory-efficient) kernel: RDNA3's needs the experimental
    switch set where memfit runs (module docstring)."""
    return card.fused_attention or os.environ.get(EXPERIMENTAL_ENV, "").strip() in ("1", "ON", "on", "true", "TRUE")
