"""Apple silicon Macs, by chip and unified memory, as the cards an MPS answer is for (``m3-max-36gb``).

A Mac's GPU has no memory of its own: it shares the RAM, and Metal offers the process a *recommended working set*
(``recommendedMaxWorkingSetSize``), which PyTorch's MPS allocator takes as its unit (``mps.py``). That share is
read from Metal's own logs as llama.cpp prints them at start-up ("recommendedMaxWorkingSetSize = N MB", N in 10^6
bytes; public issues of llama.cpp, whisper.cpp and ollama): 16 GB -> 11453.25 MB, 24 GB -> 17179.89, 32 GB ->
22906.50 (two thirds of the RAM); 36 GB -> 28991.03, 64 GB -> 51539.61 (three quarters). So: three quarters of
the RAM above 32 GiB, two thirds up to it (``working_set``). One log of an M4 with 16 GB shows 12713.12 MB (74 %):
a newer macOS may give more, so ``--working-set``-style overrides come from the user's own
``torch.mps.recommended_max_memory()`` (``memfit.mac(..., working_set=...)``).

Chips, GPU cores, memory options and bandwidth: ``research/mps/notes.md`` §6 (Apple Newsroom for M2 Ultra; the rest
from secondary reports of Apple's announcements, each named there). FP32 throughput is derived, not published by
Apple: GPU cores x 128 ALUs x 2 x the GPU clock (M1 1.278, M2 1.398, M3 1.398, M4 1.578 GHz as reported by
third-party benchmarks; unverified); fp16 and bf16 run at the same rate. These feed the planner's step time only.

Left out: Intel Macs (torch 2.13's MPS refuses a device without unified memory), the memory macOS keeps for itself
beyond what the working set leaves, and chips not listed (``mac-48gb``, or ``--unified-memory``, for those: a
generic Apple silicon Mac of that memory at an M3 Max's speeds).
"""

from __future__ import annotations

import re

from memfit.errors import MemfitError
from memfit.hardware.card import GPU

__all__ = ["MACS", "mac", "working_set", "is_mac_name"]

GiB = 1024**3
GB_S, TFLOPS = 1e9, 1e12
_CLOCK = {"m1": 1.278, "m2": 1.398, "m3": 1.398, "m4": 1.578}

# chip: (full name, GPU cores of its largest configuration, memory options in GB, bandwidth GB/s)
_CHIPS = {
    "m1": ("Apple M1", 8, (8, 16), 68), "m1-pro": ("Apple M1 Pro", 16, (16, 32), 200),
    "m1-max": ("Apple M1 Max", 32, (32, 64), 400), "m1-ultra": ("Apple M1 Ultra", 64, (64, 128), 800),
    "m2": ("Apple M2", 10, (8, 16, 24), 100), "m2-pro": ("Apple M2 Pro", 19, (16, 32), 200),
    "m2-max": ("Apple M2 Max", 38, (32, 64, 96), 400), "m2-ultra": ("Apple M2 Ultra", 76, (64, 128, 192), 800),
    "m3": ("Apple M3", 10, (8, 16, 24), 100), "m3-pro": ("Apple M3 Pro", 18, (18, 36), 150),
    "m3-max": ("Apple M3 Max", 40, (36, 48, 64, 96, 128), 400),
    "m3-ultra": ("Apple M3 Ultra", 80, (96, 256, 512), 819),
    "m4": ("Apple M4", 10, (16, 24, 32), 120), "m4-pro": ("Apple M4 Pro", 20, (24, 48, 64), 273),
    "m4-max": ("Apple M4 Max", 40, (36, 48, 64, 128), 546),
}


def working_set(memory: int) -> int:
    """Metal's recommended working set for a Mac with ``memory`` bytes of RAM (module docstring)."""
    return memory * 3 // 4 if memory > 32 * GiB else memory * 2 // 3


def _mac(name: str, full_name: str, memory: int, cores: int, bandwidth: float, chip: str,
         working: int | None = None) -> GPU:
    fp32 = cores * 128 * 2 * _CLOCK[chip.split("-")[0]] * 1e9
    return GPU(name=name, full_name=full_name, memory_bytes=memory, compute_capability=(0, 0),
               memory_bandwidth=bandwidth * GB_S, host_link="unified memory", host_link_bandwidth=bandwidth * GB_S,
               bf16_flops=fp32, fp16_flops=fp32, fp32_flops=fp32, tf32_flops=fp32, cuda_context_bytes=0,
               cublas_workspace_bytes=0, bf16=True, fp8=False, vendor="apple", arch=full_name,
               fused_attention=False, working_set_bytes=working or working_set(memory),
               source="research/mps/notes.md §6 (chip, memory, bandwidth); working set by llama.cpp's Metal logs")


MACS: dict[str, GPU] = {
    f"{chip}-{gb}gb": _mac(f"{chip}-{gb}gb", f"{full} ({gb} GB)", gb * GiB, cores, bw, chip)
    for chip, (full, cores, sizes, bw) in _CHIPS.items() for gb in sizes
}

_GENERIC = re.compile(r"^(?:mac|applesilicon)(\d+(?:\.\d+)?)gi?b$")
_CHIP_SIZE = re.compile(r"^(m[1-4](?:pro|max|ultra)?)(\d+)gb$")


def is_mac_name(compact: str) -> bool:
    """Whether a compacted name (``gpus._compact``) asks for a Mac: a chip with a size, or ``mac-NNgb``."""
    return bool(_GENERIC.match(compact) or _CHIP_SIZE.match(compact))


def mac(compact: str, working: int | None = None) -> GPU:
    """The Mac a compacted name means: ``m3max36gb`` (a listed configuration) or ``mac48gb`` (any memory);
    a chip with a memory Apple never sold it with is refused, naming the sizes it has."""
    generic = _GENERIC.match(compact)
    if generic:
        memory = int(float(generic.group(1)) * GiB)
        if memory < 8 * GiB:  # the smallest Apple silicon Mac
            raise MemfitError(f"a Mac with {generic.group(1)} GB of unified memory is too small to model: give at "
                              "least 8GB (e.g. --unified-memory 16GiB)")
        name = f"mac-{generic.group(1)}gb"
        return _mac(name, f"Apple silicon Mac ({generic.group(1)} GB)", memory, 40, 400, "m3-max", working)
    found = _CHIP_SIZE.match(compact)
    chip = re.sub(r"^(m\d)(pro|max|ultra)$", r"\1-\2", found.group(1))
    sizes = _CHIPS[chip][2]
    key = f"{chip}-{found.group(2)}gb"
    if key not in MACS:
        raise MemfitError(f"the {_CHIPS[chip][0]} comes with {', '.join(f'{s}GB' for s in sizes)} of unified "
                          f"memory, not {found.group(2)}GB: use {chip}-{sizes[0]}gb ... {chip}-{sizes[-1]}gb, or "
                          f"--unified-memory SIZE for another Mac")
    return MACS[key]
