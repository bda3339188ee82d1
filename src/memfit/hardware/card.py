"""One accelerator as the handful of numbers a memory plan and a step-time model need: the value object every
catalog (``gpus.py`` NVIDIA, ``amd.py`` AMD Instinct and Radeon, ``macs.py`` Apple silicon) fills in.

``vendor`` decides whose semantics an answer follows: ``nvidia`` CUDA's, ``amd`` ROCm's (the same caching allocator,
hipified, with ROCm's BLAS workspaces and attention kernels: ``amd.py``), ``apple`` MPS's (Metal heaps and the
working set macOS gives the GPU: ``mps.py``). Units are SI and plain numbers: bytes, bytes/s, FLOP/s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["GPU", "SEMANTICS"]

#: the runtime whose rules an answer follows, by vendor
SEMANTICS = {"nvidia": "CUDA", "amd": "ROCm", "apple": "MPS"}


@dataclass(frozen=True)
class GPU:
    name: str  # catalog key
    full_name: str  # as the vendor (and torch's device name) calls it
    memory_bytes: int  # cudaDeviceProp.totalGlobalMem (= torch total_memory) where a log was found; a Mac's RAM
    compute_capability: tuple[int, int]  # torch.cuda.get_device_capability(): sm on NVIDIA, gfx major.minor on ROCm
    memory_bandwidth: float  # bytes/s, peak DRAM
    host_link: str  # which link host_link_bandwidth is
    host_link_bandwidth: float  # bytes/s per direction
    bf16_flops: float  # dense bf16 tensor, FP32 accumulate (pre-sm80: no bf16 units; FP32 rate)
    fp16_flops: float  # dense fp16 tensor, FP32 accumulate
    fp32_flops: float  # non-tensor FP32 (CUDA cores)
    tf32_flops: float  # dense TF32 tensor (pre-sm80: no TF32; FP32 rate)
    cuda_context_bytes: int  # the driver's context outside the allocator (CUDA's, or HIP's; 0 on a Mac)
    cublas_workspace_bytes: int  # the workspace a thread's matmuls take (cuBLAS's; hipBLASLt's on ROCm)
    bf16: bool = False  # native bf16 (sm80+)
    fp8: bool = False  # fp8 tensor cores (sm89+)
    vendor: str = "nvidia"  # nvidia | amd | apple: whose semantics (``SEMANTICS``)
    arch: str = ""  # ROCm's gcnArchName (gfx942) or Apple's chip (M3 Max); "" for NVIDIA (compute_capability says it)
    # (library, bytes) of the BLAS workspaces a thread takes from the allocator: the first for matrix products, the
    # second (if any) for the vector ones (mv, addmv, dot): ROCm's hipBLASLt and hipBLAS (amd.py); () = one cuBLAS
    # workspace of cublas_workspace_bytes for all; a Mac none.
    workspaces: tuple[tuple[str, int], ...] = ()
    fused_attention: bool = True  # SDPA's flash / memory-efficient kernels run here (else the math path)
    working_set_bytes: int | None = None  # a Mac's recommendedMaxWorkingSetSize (the GPU's share of RAM)
    source: str = ""  # where the figures come from, in short (the module's comments say it in full)

    @property
    def semantics(self) -> str:
        return SEMANTICS[self.vendor]

    @property
    def blas_workspaces(self) -> tuple[tuple[str, int], ...]:
        if self.vendor == "apple":
            return ()
        return self.workspaces or (("cuBLAS", self.cublas_workspace_bytes),)

    @property
    def memory(self) -> int:
        return self.memory_bytes

    @property
    def outside_bytes(self) -> int:
        """What a training process holds outside torch's allocator on this card: the CUDA context and the
        libraries it loads (cuBLAS, attention and step kernels; ``hardware/outside.py``)."""
        from memfit.hardware.outside import outside

        return outside(self).bytes

    def usable_bytes(self) -> int:
        """What torch's allocator can get: total memory less what a training process holds outside it (on a Mac:
        the recommended working set, what the GPU holds without swapping: ``mps.py``)."""
        if self.vendor == "apple":
            return self.working_set_bytes
        return self.memory_bytes - self.outside_bytes

    def allowed_bytes(self, budget: int | None = None) -> int:
        """What torch's allocator may hold under a process ``budget`` (bytes, what nvidia-smi counts; None:
        the whole card): the budget less ``outside_bytes``, never more than the card's usable bytes. A run keeps
        to a budget with ``set_per_process_memory_fraction(allowed_bytes(budget) / total_memory)``, and
        ``estimator/verdict.py`` replays the step under the same limit."""
        if budget is None:
            return self.usable_bytes()
        return min(self.usable_bytes(), max(int(budget) - self.outside_bytes, 0))

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["compute_capability"] = list(self.compute_capability)
        out["workspaces"] = [list(w) for w in self.workspaces]
        out["blas_workspaces"] = [list(w) for w in self.blas_workspaces]
        out["semantics"] = self.semantics
        out["usable_bytes"] = self.usable_bytes()
        out["outside_bytes"] = self.outside_bytes
        return out
