"""Well-known NVIDIA GPUs as the handful of numbers a memory plan and a step-time model need.

Units are SI and plain numbers: bytes, bytes/s, FLOP/s. Throughputs are dense (no 2:4 sparsity,
which NVIDIA's headline figures usually include: those are halved here) and, for 16-bit tensor
math, with FP32 accumulation, which is what PyTorch's matmuls use. GeForce cards run FP32
accumulation at half their FP16-accumulate rate; workstation and data-center cards at full rate.

Sources are named in each comment: NVIDIA datasheets and whitepapers (the publisher's address; the
figures were read from public copies of them, not fetched live), PyTorch's source for workspace
sizes, and public logs of ``torch.cuda.get_device_properties()`` / CUDA ``deviceQuery`` for the
memory the driver actually reports (``cudaDeviceProp.totalGlobalMem``, which is what torch's
``total_memory`` is). That figure is below the marketing size (ECC, driver reservations) and moves
by a few MiB across drivers; where logs disagree the comment gives the range.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass

from memfit.errors import MemfitError
from memfit.hardware.amd import AMD, AMD_ALIASES, AMD_PEER_LINKS
from memfit.hardware.card import GPU
from memfit.hardware.macs import MACS, is_mac_name, mac

__all__ = ["ALIASES", "CATALOG", "GPU", "gpu", "gpu_names", "peer_link", "NETWORK_BANDWIDTH"]

MiB = 1024**2
GB_S = 1e9  # datasheets give bandwidth in decimal GB/s and TB/s
TFLOPS = 1e12

# cuBLAS workspace torch allocates from its caching allocator, once per (cuBLAS handle, stream),
# i.e. per thread that runs matmuls on a stream (the forward thread and autograd's backward thread
# are two). Source: pytorch/pytorch aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize():
#   "/* :4096:2:16:8 default, 32MiB for Hopper */" -> sm90 ? 4096 * 8 * 1024 : 4096 * 1024 * 2 + 16 * 1024 * 8
# and since pytorch/pytorch#175344 (Feb 2026) `major == 9 || major == 10 || major == 12` get 32 MiB
# (the revert, #182669, was closed unmerged). Older torch releases give Blackwell the 8 MiB + 128 KiB
# default. CUBLAS_WORKSPACE_CONFIG=:SIZE_KiB:COUNT[...] overrides both. With the unified cuBLASLt
# workspace (default outside fbcode since #168175, #173002, #175879) cuBLASLt reuses this buffer, so there is no
# second one. The project's own H100 trace (bench/results/cuda-traces-h100.json.gz, torch 2.11) shows
# the 33554432-byte segment.
_WORKSPACE_32MIB = 4096 * 8 * 1024
_WORKSPACE_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8  # ":4096:2:16:8" = 8,519,680 bytes


def _cublas_workspace(cc: tuple[int, int]) -> int:
    return _WORKSPACE_32MIB if cc[0] in (9, 10, 12) else _WORKSPACE_DEFAULT


# CUDA context: device memory the driver takes at the first CUDA call, outside torch's allocator
# (kernel images of the loaded modules, per-SM local-memory/stack reservation, driver structures).
# It scales with SM count and grows as lazily-loaded kernels (cuBLAS, cuDNN, NCCL, Triton) arrive,
# so these are the bare figure at startup; leave a margin on top.
#  - Ampere GA102 (sm86): 256 MiB measured on an RTX 3090, torch 2.7.1+cu128, driver 610
#    (invoke-ai/InvokeAI#9413, "a flat 256 MiB" in nvidia-smi).
#  - Ada AD102 (sm89): 426 MiB measured on an RTX 6000 Ada (142 SMs, same die as the 4090/L40S),
#    torch 2.10.0+cu130, nvidia-smi after torch.cuda.mem_get_info() (unslothai/unsloth-zoo#1053).
#  - Volta/Turing: 300-400 MB measured on a V100 (AWS p3.8xlarge), pytorch/pytorch#20532.
#  - Others: not measured per architecture. 512 MiB sits between ptrblck's "around 400MB" with
#    lazy loading (pytorch/pytorch#109888, #107667) and ~616 MiB seen for a bare context on a
#    data-center node (LMCache/LMCache#4019); big-SM-count parts (A100/H100/B200) sit at the top.
_CONTEXT_SM86 = 256 * MiB  # measured
_CONTEXT_SM89 = 426 * MiB  # measured
_CONTEXT_VOLTA_TURING = 384 * MiB  # measured range 300-400 MB
#  - Hopper GH100 (sm90): 552,402,944 bytes (526.8 MiB) measured on an H200 (torch 2.11.0+cu130, driver 580):
#    device used less reserved after torch.cuda.init() and a 1-element tensor (bench/gpu/cuda_outside.py); the
#    H100 is the same die with the same SM count. What the libraries add on top: hardware/outside.py.
_CONTEXT_SM86 = 256 * MiB  # measured
_CONTEXT_SM89 = 426 * MiB  # measured
_CONTEXT_HOPPER = 552_402_944  # measured (H200)
_CONTEXT_VOLTA_TURING = 384 * MiB  # measured range 300-400 MB
_CONTEXT_TYPICAL = 512 * MiB  # typical, not measured on these parts

# Host link, bytes/s per direction: the datasheets' bidirectional x16 figure halved
# (PCIe Gen3 32 GB/s, Gen4 64 GB/s, Gen5 128 GB/s bidirectional). After 128b/130b encoding the raw
# link is 15.75 / 31.5 / 63 GB/s; pinned-memory copies typically reach 80-90 % of that.
_PCIE3, _PCIE4, _PCIE5 = 16 * GB_S, 32 * GB_S, 64 * GB_S


def _gpu(name, full_name, memory_bytes, cc, bw_gb_s, link, link_bw, bf16_tf, fp16_tf, fp32_tf, tf32_tf, context):
    return GPU(
        name=name, full_name=full_name, memory_bytes=int(memory_bytes), compute_capability=cc,
        memory_bandwidth=bw_gb_s * GB_S, host_link=link, host_link_bandwidth=link_bw,
        bf16_flops=bf16_tf * TFLOPS, fp16_flops=fp16_tf * TFLOPS, fp32_flops=fp32_tf * TFLOPS,
        tf32_flops=tf32_tf * TFLOPS, cuda_context_bytes=int(context),
        cublas_workspace_bytes=_cublas_workspace(cc), bf16=cc >= (8, 0), fp8=cc >= (8, 9))


CATALOG: dict[str, GPU] = {
    # --- consumer / workstation -----------------------------------------------------------------
    # GeForce RTX 3090: NVIDIA Ampere GA102 GPU Architecture whitepaper v2, Appendix A
    # (https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf):
    # 936 GB/s; FP32 35.6; FP16 and BF16 tensor with FP32 accumulate 71 (142 sparse); TF32 35.6.
    # Memory: torch repr "total_memory=24268MB" (Hugging Face docs' get_device_properties example;
    # 24268 MiB = 25,446,842,368 bytes, the same figure in Alibaba's GPU-trace table); one log 24259.
    "rtx-3090": _gpu("rtx-3090", "NVIDIA GeForce RTX 3090", 25_446_842_368, (8, 6), 936, "PCIe 4.0 x16",
                     _PCIE4, 71, 71, 35.6, 35.6, _CONTEXT_SM86),
    # GeForce RTX 4090: NVIDIA Ada GPU Architecture whitepaper, Appendix
    # (https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf):
    # 1008 GB/s; FP32 82.6; FP16/BF16 tensor with FP32 accumulate 165.2 (330.4 sparse); TF32 82.6.
    # Memory: 25,757,220,864 bytes (24564 MiB), torch_vram_total in a ComfyUI /system_stats dump;
    # another torch repr shows "total_memory=24563MB".
    "rtx-4090": _gpu("rtx-4090", "NVIDIA GeForce RTX 4090", 25_757_220_864, (8, 9), 1008, "PCIe 4.0 x16",
                     _PCIE4, 165.2, 165.2, 82.6, 82.6, _CONTEXT_SM89),
    # GeForce RTX 5090: NVIDIA RTX Blackwell GPU Architecture whitepaper (https://images.nvidia.com/
    # aem-dam/Solutions/geforce/blackwell/nvidia-rtx-blackwell-gpu-architecture.pdf): 170 SMs,
    # 2407 MHz boost, 32 GB GDDR7 at 1792 GB/s, PCIe 5.0 x16;
    # FP32 104.8; FP16 tensor 838 sparse / 419 dense (the headline, FP16-accumulate figure).
    # FP32 accumulate (what torch uses) taken as half that, 209.5, like every GeForce before it: torch bf16 matmuls
    # measured at 235-240 TFLOPS (zzc0721/torch-performance-test-data #15, #96) match 209.5 scaled
    # to the ~2.8 GHz the cards actually hold, not 419. TF32 104.8 likewise. Memory: deviceQuery
    # 33,680,457,728 bytes (32120 MiB), NVIDIA/nccl#1637; another card 33,677,180,928.
    "rtx-5090": _gpu("rtx-5090", "NVIDIA GeForce RTX 5090", 33_680_457_728, (12, 0), 1792, "PCIe 5.0 x16",
                     _PCIE5, 209.5, 209.5, 104.8, 104.8, _CONTEXT_TYPICAL),
    # RTX A6000: GA102 whitepaper v2, RTX A6000 appendix / A6000 datasheet: 768 GB/s; FP32 38.7;
    # FP16/BF16 tensor with FP32 accumulate 154.8 (309.7 sparse, full rate on workstation parts);
    # TF32 77.4. Memory: torch repr "total_memory=48676MB" (51,040,485,376 bytes); a deviceQuery on
    # driver 12.7 shows 51,160,023,040 (ECC off vs on moves it).
    "a6000": _gpu("a6000", "NVIDIA RTX A6000", 48676 * MiB, (8, 6), 768, "PCIe 4.0 x16",
                  _PCIE4, 154.8, 154.8, 38.7, 77.4, _CONTEXT_SM86),
    # --- data center ----------------------------------------------------------------------------
    # A10G (AWS G5 only; NVIDIA publishes no A10G datasheet). 24 GB GDDR6 at 600 GB/s, as the A10
    # (https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/a10-datasheet.pdf).
    # Compute is derived, not published: 80 SMs x 1.71 GHz gives FP32 35.0; GA102 tensor cores at
    # the GeForce half rate for FP32 accumulate give 70 FP16/BF16 and 35 TF32. That fits Baseten's
    # "NVIDIA A10 vs A10G" (https://www.baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference/):
    # the A10 has more tensor compute, the A10G more CUDA-core compute (A10: 125 BF16, 31.2 FP32).
    # Memory: torch repr "total_memory=22587MB" (23,684,186,112 bytes).
    "a10g": _gpu("a10g", "NVIDIA A10G", 22587 * MiB, (8, 6), 600, "PCIe 4.0 x16",
                 _PCIE4, 70, 70, 35, 35, _CONTEXT_SM86),
    # L4: datasheet (https://www.nvidia.com/en-us/data-center/l4/): 300 GB/s; FP32 30.3; TF32 120,
    # BF16/FP16 242, FP8 485 — all "with sparsity", halved here; PCIe Gen4 x16 64 GB/s bidir.
    # Memory: deviceQuery 23,612,293,120 bytes (22518 MiB; nvidia-smi says 23034 MiB).
    "l4": _gpu("l4", "NVIDIA L4", 23_612_293_120, (8, 9), 300, "PCIe 4.0 x16",
               _PCIE4, 121, 121, 30.3, 60, _CONTEXT_SM89),
    # L40S: datasheet (https://www.nvidia.com/en-us/data-center/l40s/): 864 GB/s; FP32 91.6;
    # TF32 183 (366 sparse); BF16/FP16 362.05 (733 sparse); PCIe Gen4 x16 64 GB/s bidir. Memory:
    # deviceQuery 47,576,711,168 bytes (45373 MiB, cuda-device-query README); a torch repr shows
    # 45589 MiB; nvidia-smi 46068 MiB (ECC on by default).
    "l40s": _gpu("l40s", "NVIDIA L40S", 47_576_711_168, (8, 9), 864, "PCIe 4.0 x16",
                 _PCIE4, 362.05, 362.05, 91.6, 183, _CONTEXT_SM89),
    # T4: datasheet (https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf):
    # 320 GB/s; FP32 8.1; mixed FP16/FP32 tensor 65; PCIe Gen3 x16. No bf16 or TF32 units: both
    # set to the FP32 rate (torch emulates bf16; that is a ceiling). Memory: torch repr
    # "total_memory=15109MB" on Colab (15,842,934,784 bytes); other logs 15079-15102 MiB.
    "t4": _gpu("t4", "NVIDIA T4", 15_842_934_784, (7, 5), 320, "PCIe 3.0 x16",
               _PCIE3, 8.1, 65, 8.1, 8.1, _CONTEXT_VOLTA_TURING),
    # V100 SXM2: datasheet (https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf):
    # 900 GB/s; FP32 15.7; tensor (FP16, FP32 accumulate) 125; PCIe Gen3 x16 host link (NVLink
    # 300 GB/s is GPU-GPU). No bf16/TF32: FP32 rate. Memory: torch repr "total_memory=16160MB"
    # (16,944,988,160 bytes; one log 16130 MiB) and "32510MB" (34,089,205,760 bytes).
    "v100-16gb": _gpu("v100-16gb", "NVIDIA Tesla V100-SXM2-16GB", 16_944_988_160, (7, 0), 900, "PCIe 3.0 x16",
                      _PCIE3, 15.7, 125, 15.7, 15.7, _CONTEXT_VOLTA_TURING),
    "v100-32gb": _gpu("v100-32gb", "NVIDIA Tesla V100-SXM2-32GB", 34_089_205_760, (7, 0), 900, "PCIe 3.0 x16",
                      _PCIE3, 15.7, 125, 15.7, 15.7, _CONTEXT_VOLTA_TURING),
    # A100 SXM4: datasheet (https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf):
    # 40GB 1,555 GB/s, 80GB 2,039 GB/s; FP32 19.5; TF32 156; BF16/FP16 312 (624 sparse); PCIe Gen4
    # 64 GB/s bidir. Memory: 40GB deviceQuery 42,405,855,232 bytes (40441 MiB, Paderborn PC2 docs;
    # Paddle's example shows 40536 MiB); 80GB deviceQuery 84,987,740,160 bytes (81051 MiB), others
    # 85,100,068,864 (81158 MiB) and 85,198,045,184 (81251 MiB) on other drivers.
    "a100-40gb": _gpu("a100-40gb", "NVIDIA A100-SXM4-40GB", 42_405_855_232, (8, 0), 1555, "PCIe 4.0 x16",
                      _PCIE4, 312, 312, 19.5, 156, _CONTEXT_TYPICAL),
    "a100-80gb": _gpu("a100-80gb", "NVIDIA A100-SXM4-80GB", 84_987_740_160, (8, 0), 2039, "PCIe 4.0 x16",
                      _PCIE4, 312, 312, 19.5, 156, _CONTEXT_TYPICAL),
    # H100: datasheet (https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet)
    # and Hopper whitepaper (https://resources.nvidia.com/en-us-tensor-core/gtc22-whitepaper-hopper): SXM 3.35 TB/s, FP32 66.9, TF32 494.7, BF16/FP16 989.4 (1979 sparse);
    # PCIe 2 TB/s, FP32 51.2, TF32 378, BF16/FP16 756.5 (1513 sparse); both PCIe Gen5 128 GB/s
    # bidir. Memory: SXM 85,029,158,912 bytes (81090 MiB; torch 2.7 repr "81089MB", others 81082-81090);
    # PCIe torch repr "total_memory=81008MB" (84,943,044,608 bytes).
    "h100-sxm": _gpu("h100-sxm", "NVIDIA H100 80GB HBM3 (SXM5)", 85_029_158_912, (9, 0), 3350, "PCIe 5.0 x16",
                     _PCIE5, 989.4, 989.4, 66.9, 494.7, _CONTEXT_HOPPER),
    "h100-pcie": _gpu("h100-pcie", "NVIDIA H100 PCIe", 81008 * MiB, (9, 0), 2000, "PCIe 5.0 x16",
                      _PCIE5, 756.5, 756.5, 51.2, 378, _CONTEXT_HOPPER),
    # H200 SXM: datasheet (https://www.nvidia.com/en-us/data-center/h200/): 141 GB HBM3e at 4.8 TB/s;
    # compute identical to H100 SXM (FP32 67 — 66.9 in the Hopper whitepaper — TF32 989 / BF16
    # 1979 sparse); PCIe Gen5 128 GB/s bidir.
    # Memory: torch repr "total_memory=143156MB" (150,109,945,856 bytes; nvidia-smi 143771 MiB).
    "h200": _gpu("h200", "NVIDIA H200 (SXM)", 143156 * MiB, (9, 0), 4800, "PCIe 5.0 x16",
                 _PCIE5, 989.4, 989.4, 66.9, 494.7, _CONTEXT_HOPPER),
    # B200 (HGX, 1000 W): HGX B200 spec (https://www.nvidia.com/en-us/data-center/hgx/), per GPU of 8:
    # 8 TB/s; FP16/BF16 4.5 PFLOPS sparse -> 2.25 dense; TF32 2.2 sparse -> 1.1 dense; FP32 75
    # (600 TFLOPS per 8-GPU board; some tables say 80). Less firm than the rest: NVIDIA's per-GPU
    # figures vary with power configuration and revision. Host link PCIe Gen5 x16 (NVLink 5 is
    # GPU-GPU). Memory: torch repr "total_memory=182631MB" (191,502,483,456 bytes; another 182642 MiB).
    "b200": _gpu("b200", "NVIDIA B200 (HGX)", 182631 * MiB, (10, 0), 8000, "PCIe 5.0 x16",
                 _PCIE5, 2250, 2250, 75, 1100, _CONTEXT_TYPICAL),
}

# AMD Instinct and Radeon cards (ROCm semantics, ``amd.py``) and Apple silicon Macs (MPS semantics, ``macs.py``)
CATALOG.update(AMD)
CATALOG.update(MACS)

# Other spellings, compared after _compact(): lowercase, vendor words dropped, only letters and
# digits kept, so "RTX 4090", "rtx_4090" and torch's device names ("NVIDIA A100-SXM4-80GB") all land.
# Bare "a100" means the 80GB SXM part (the 40GB launch part was replaced across the market);
# bare "v100" means the 16GB SXM2 part (what AWS p3 and Google Cloud rent); bare "h100" the SXM.
ALIASES: dict[str, str] = {
    "3090": "rtx-3090", "4090": "rtx-4090", "5090": "rtx-5090", "rtxa6000": "a6000",
    "v100": "v100-16gb", "v100sxm216gb": "v100-16gb", "v10016gb": "v100-16gb",
    "v100sxm232gb": "v100-32gb", "v10032gb": "v100-32gb",
    "a100": "a100-80gb", "a100sxm": "a100-80gb", "a100sxm480gb": "a100-80gb", "a10080gb": "a100-80gb",
    "a100sxm440gb": "a100-40gb", "a10040gb": "a100-40gb",
    "h100": "h100-sxm", "h100sxm5": "h100-sxm", "h10080gbhbm3": "h100-sxm", "h100sxm580gb": "h100-sxm",
    "h200sxm": "h200", "b200hgx": "b200", **AMD_ALIASES,
}

_VENDOR = re.compile(r"^(nvidia|geforce|tesla|amd|instinct|radeon|apple)+")


def _compact(name: str) -> str:
    return _VENDOR.sub("", re.sub(r"[^a-z0-9]", "", name.lower()))


_LOOKUP = {_compact(key): key for key in CATALOG} | {_compact(a): key for a, key in ALIASES.items()}


# GPU-to-GPU bandwidth per direction within a node, for the planner's collectives
# (``planner/ranks.py``). NVLink totals are NVIDIA's bidirectional figures, halved: V100 SXM2 NVLink 2
# 300 GB/s, A100 SXM4 NVLink 3 600 GB/s, H100 SXM5 / H200 NVLink 4 900 GB/s, B200 NVLink 5 1.8 TB/s
# (datasheets). Cards without NVLink in the catalog exchange over PCIe: their host link.
_NVLINK = {"v100-16gb": 150e9, "v100-32gb": 150e9, "a100-40gb": 300e9, "a100-80gb": 300e9,
           "h100-sxm": 450e9, "h200": 450e9, "b200": 900e9}
#: bytes/s per GPU per direction between nodes: 400 Gb/s (one NDR InfiniBand / RoCE NIC per GPU, as
#: in torchtitan's Grand Teton runs and NVIDIA's HGX reference designs). An assumption: say yours.
NETWORK_BANDWIDTH = 50e9


def peer_link(card: GPU) -> tuple[str, float]:
    """(name, bytes/s per direction) of the link between two GPUs of one node."""
    if card.name in _NVLINK:
        return "NVLink", _NVLINK[card.name]
    if card.name in AMD_PEER_LINKS:
        return AMD_PEER_LINKS[card.name]
    return card.host_link, card.host_link_bandwidth


def gpu_names() -> list[str]:
    """The catalog's names, sorted."""
    return sorted(CATALOG)


def gpu(name: str) -> GPU:
    """The GPU called ``name`` (case-insensitive; aliases and torch device names accepted)."""
    compact = _compact(str(name))
    key = _LOOKUP.get(compact)
    if key is not None:
        return CATALOG[key]
    if is_mac_name(compact):
        return mac(compact)
    close = difflib.get_close_matches(str(name).strip().lower(), gpu_names(), n=2, cutoff=0.5)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    raise MemfitError(f"unknown GPU {name!r}: {hint}known: {', '.join(n for n in gpu_names() if n not in MACS)}, "
                      f"Macs as m3-max-36gb (memfit gpus); or a size: --budget 24GiB, --unified-memory 48GiB")


#: The card memfit answers for when no GPU is given and none is visible: the most common training card in
#: the published runs memfit is measured against (torchtitan's, the transformers guides'). Named in every
#: answer that assumes it.
DEFAULT_GPU = "h100-sxm"
#: ``MEMFIT_DEVICE=cpu`` makes CPU semantics the default where neither ``device`` nor ``gpu`` is given.
DEVICE_ENV = "MEMFIT_DEVICE"


@dataclass(frozen=True)
class Target:
    """Whose semantics an answer follows: ``gpu`` None for the CPU's; ``how`` says where the card came from:
    ``given`` (gpu= / --gpu), ``visible`` (the GPU torch sees), ``default`` (none visible: ``DEFAULT_GPU``),
    ``cpu`` (device="cpu" / --device cpu, or ``MEMFIT_DEVICE=cpu``)."""

    gpu: GPU | None
    how: str

    @property
    def device(self) -> str:
        return "cpu" if self.gpu is None else "cuda"


def visible_gpu() -> GPU | None:
    """The GPU torch sees (device 0), as a catalog card when its name is known, else a card made from its own
    total memory and compute capability (speeds of the catalog card of the same architecture); None when torch
    sees no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    try:
        return gpu(props.name)
    except MemfitError:
        pass
    cc = (props.major, props.minor)
    vendor = "amd" if torch.version.hip else "nvidia"  # a ROCm build: the nearest AMD card, with ROCm's workspaces
    near = min((card for card in CATALOG.values() if card.vendor == vendor),
               key=lambda card: (abs(card.compute_capability[0] - cc[0]) * 10 + abs(card.compute_capability[1] - cc[1]),
                                 abs(card.memory_bytes - props.total_memory)))
    own = {} if vendor == "amd" else dict(cublas_workspace_bytes=_cublas_workspace(cc), bf16=cc >= (8, 0),
                                          fp8=cc >= (8, 9))
    return dataclasses.replace(near, name=_compact(props.name) or "cuda", full_name=props.name,
                               memory_bytes=int(props.total_memory), compute_capability=cc, **own)


def target(device=None, card=None) -> Target:
    """Whose semantics to follow, as every verb decides it: ``card`` (a name or a ``GPU``) if given; else
    ``device="cpu"`` (or ``MEMFIT_DEVICE=cpu`` when ``device`` is None) for the CPU's; else the GPU torch sees;
    else ``DEFAULT_GPU``."""
    import os

    kind = None if device is None else str(device).split(":")[0]
    if kind not in (None, "cpu", "cuda", "mps"):
        raise MemfitError(f"device {shown_device(device)} is not modelled: use device='cpu', 'cuda' or 'mps'")
    if kind == "mps" and card is None:
        return Target(this_mac(), "visible")
    if card is not None:
        if kind == "cpu":
            raise MemfitError("gpu and device='cpu' conflict: drop one")
        return Target(card if isinstance(card, GPU) else gpu(card), "given")
    if kind is None:
        env = os.environ.get(DEVICE_ENV, "").strip().lower()
        if env not in ("", "cpu", "cuda"):
            raise MemfitError(f"{DEVICE_ENV}={env[:20]!r} is not a device: set it to cpu or cuda, or unset it")
        kind = env or "cuda"
    if kind == "cpu":
        return Target(None, "cpu")
    seen = visible_gpu()
    return Target(seen, "visible") if seen is not None else Target(CATALOG[DEFAULT_GPU], "default")


def this_mac() -> GPU:
    """The Mac memfit runs on, as MPS sees it: its RAM and Metal's own working set (``torch.mps``); one line where
    there is no MPS device."""
    import os

    import torch

    from memfit.hardware.mps import require_mps

    require_mps()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return mac(f"mac{ram / 2**30:g}gb", working=torch.mps.recommended_max_memory())


def shown_device(device) -> str:
    text = repr(device)
    return text if len(text) <= 40 else text[:37] + "..."
