"""Device memory a CUDA process holds outside torch's caching allocator: what nvidia-smi adds to
``torch.cuda.max_memory_reserved()``.

``memory_reserved`` counts only the allocator's segments. The driver and the libraries torch loads take
device memory of their own, through the driver, where no torch statistic sees it: the CUDA context
(per-SM local memory and stack, the loaded module images of torch's own kernels), cuBLAS/cuBLASLt's
handle and kernels at the first matmul, the fused attention kernels, the backward's and the optimizer's
kernels, an NCCL communicator's buffers. nvidia-smi (NVML) and ``torch.cuda.mem_get_info`` count all of
it. This module says how much, term by term, for a process that runs a given :class:`Workload` on a card.

Written by hand because no library reports it: torch's allocator does not see it, NVML sees only the
total of a live process, and the libraries publish no sizes (cuBLAS's and NCCL's memory depends on the
kernels a run loads and the buffers its peers need).

Where the figures come from (each term carries its source):

* **Lazy loading.** Since CUDA 11.7 a module's kernels are loaded at their first launch when
  ``CUDA_MODULE_LOADING=LAZY``, and torch sets that itself when the variable is unset (since torch 1.13,
  pytorch/pytorch#85692; CUDA 12.2 made lazy loading the driver's own default). So what
  a library adds depends on the kernels a run uses, not on what the library ships. With eager loading
  (older CUDA, or ``CUDA_MODULE_LOADING=EAGER``) every kernel of torch's own library is loaded at init, so
  no step or forward kernels arrive later, and cuBLAS loads all of its own at its first handle (more than
  the lazy figure; how much is not measured here): the Hugging Face single-GPU guide measured 1,343 MiB for
  the context alone on a V100 (CUDA 11.2), which is :data:`EAGER_CONTEXT` here.
* **H200, torch 2.11.0+cu130, driver 580, cuDNN 9.19, NCCL 2.28.9** (``bench/gpu/cuda_outside.py`` ->
  ``bench/results/cuda-outside-h200.json``; ``bench/gpu/gpu_check.py``'s truths, each case in a fresh process
  -> ``gpu-check-h200-truths.json``), device used (``cudaMemGetInfo``: total - free) less reserved:
  526.8 MiB after CUDA init; +158.0 MiB at the first matmul (cuBLAS and cuBLASLt: the bf16 and fp16
  matmuls after it add nothing). What else a run loads (attention kernels, cuDNN's engines, the backward's
  and the optimizer's kernels) arrives in a few chunks, not per library: in the step-by-step run SDPA
  added 18 MiB and cuDNN's convolution and LSTM then nothing, while 11 of 13 training truths — bf16, fp16,
  fp32 CNN, compiled, LoRA, MoE — held exactly 804,061,184 bytes outside (766.8 MiB: the context, cuBLAS
  and 82.0 MiB of step kernels), the fp32 Llama-3.2-1B 750.8 (66.0) and the MoE 768.8 (84.0). A
  generation: 716.9 (Llama-3.2-1B, 32.1 MiB of forward kernels) and 700.8 (Qwen3-8B, 16.0). +0 for an
  Inductor/Triton kernel. FSDP2 over NCCL at world size 1: +70.1 MiB (the communicator made lazily at the
  first collective, as torchrun scripts do), with CPU offload +68.0 MiB more; an NCCL communicator made
  eagerly (``init_process_group(device_id=...)``) and an all-reduce: +560.0 MiB (172 MiB kept after it is
  destroyed).
* The H100 is the same die (GH100, 132 SMs) under the same software: the H200 row stands for it. Other
  cards: their context is ``GPU.cuda_context_bytes`` (``gpus.py``, measured or sourced there); the library
  terms are the H200's, marked *assumed*: lazily loaded images are the kernels a run uses, which differ
  by architecture in binary size, not by the card's memory.
* An NCCL communicator with peers (world size > 1) also holds its channels' buffers (``NCCL_BUFFSIZE``,
  4 MiB by default, per channel and peer, for each protocol): not measured here; memfit counts the eager
  communicator's 560 MiB for each communicator with peers and says it is a range (70 MiB, world size 1,
  lazy, to an unmeasured upper end for many channels).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["EAGER_CONTEXT", "Outside", "Term", "Workload", "outside"]

MiB = 2 ** 20

#: the CUDA context with eager module loading: "GPU memory occupied: 1343 MB" after one 1x1 tensor on a
#: V100 (CUDA 11.2, torch ~1.10), Hugging Face transformers docs, perf_train_gpu_one (2022-01-11)
EAGER_CONTEXT = 1343 * MiB

# Measured on the H200 (module docstring): device used - reserved, in bytes
_H200 = "H200, torch 2.11.0+cu130, CUDA 13 lazy loading (bench/results/cuda-outside-h200.json, gpu-check-h200-truths.json)"
_CUBLAS = 165_675_008  # +158.0 MiB at the first matmul (cuBLAS + cuBLASLt handles, the kernels loaded)
_STEP_KERNELS = 85_983_232  # 82.0 MiB: a training step's other kernels (11 of 13 training runs)
_STEP_KERNELS_LOW, _STEP_KERNELS_HIGH = 69_206_016, 88_080_384  # 66.0 (fp32 Llama-3.2-1B), 84.0 (MoE)
_FORWARD_KERNELS = 33_619_968  # 32.1 MiB: a generation's (Llama-3.2-1B)
_FORWARD_KERNELS_LOW = 16 * MiB  # Qwen3-8B's generation
_NCCL_LAZY_WORLD1 = 73_465_856  # FSDP2 at world size 1: the communicator made at the first collective
_NCCL_EAGER = 587_202_560  # an eagerly made communicator and one all-reduce (world size 1)
_OFFLOAD = 71_303_168  # FSDP2's CPUOffloadPolicy on top (pinned copies' streams and kernels)


@dataclass(frozen=True)
class Term:
    """One part of the memory outside the allocator: ``bytes`` counted, ``low``-``high`` the range it is
    known to within, ``source`` where the figure comes from, ``measured`` False where it is assumed for
    this card from another."""

    name: str
    bytes: int
    low: int
    high: int | None  # None: no upper end known
    source: str
    measured: bool = True


@dataclass(frozen=True)
class Workload:
    """What the process runs, as far as it decides the libraries loaded.

    kind            ``train`` (forward, backward, optimizer) or ``generate`` (forwards: prefill and decode).
    matmul          a matmul runs (cuBLAS / cuBLASLt load).
    communicators   NCCL communicators the process makes (one per process group with peers; 0 alone).
    world_size      ranks in the run (a world of 1 has no peers: its communicator is small).
    offload         FSDP2's CPU offload runs (pinned copies on their own streams).
    eager_loading   ``CUDA_MODULE_LOADING=EAGER`` or CUDA < 11.7: every kernel loaded at init.
    context_bytes   the context as measured on the user's own machine (None: the card's figure).
    """

    kind: str = "train"
    matmul: bool = True
    communicators: int = 0
    world_size: int = 1
    offload: bool = False
    eager_loading: bool = False
    context_bytes: int | None = None


@dataclass(frozen=True)
class Outside:
    """The memory a process holds outside torch's allocator on one card, term by term."""

    card: str
    terms: tuple[Term, ...]

    @property
    def bytes(self) -> int:
        return sum(t.bytes for t in self.terms)

    @property
    def low(self) -> int:
        return sum(t.low for t in self.terms)

    @property
    def high(self) -> int | None:
        highs = [t.high for t in self.terms]
        return None if None in highs else sum(highs)

    @property
    def context_bytes(self) -> int:
        return sum(t.bytes for t in self.terms if t.name in ("CUDA context", "HIP context"))

    def to_dict(self) -> dict:
        return {"card": self.card, "bytes": self.bytes, "low": self.low, "high": self.high,
                "terms": [asdict(t) for t in self.terms]}


_MPS_OTHER = ("not measured: what MPSGraph and Metal hold besides torch's heaps; users' out-of-memory messages show "
              "from 480 KiB to 14.76 GB of it (research/mps/notes.md §7)")


def _hopper(card) -> bool:
    return tuple(card.compute_capability)[0] == 9


def outside(card, workload: Workload | None = None) -> Outside:
    """What a process running ``workload`` (default: one training process) holds outside torch's allocator
    on ``card`` (a ``hardware.gpus.GPU``): the CUDA context and what each library it loads adds."""
    work = workload or Workload()
    if work.kind not in ("train", "generate"):
        raise ValueError(f"workload kind {work.kind!r}: use 'train' or 'generate'")
    vendor = getattr(card, "vendor", "nvidia")
    if vendor == "apple":  # Metal's own and MPSGraph's allocations ("other allocations" in MPS's message)
        return Outside(card.name, (Term("MPSGraph and Metal", 0, 0, None, _MPS_OTHER, measured=False),))
    hopper = _hopper(card) and vendor == "nvidia"
    where = _H200 if hopper else f"{_H200}; assumed for the {card.name} (not measured on it)"
    if vendor == "amd":
        where = f"{_H200}; assumed for the {card.name}: no HIP, rocBLAS/hipBLASLt or RCCL figure was found"
    terms = []
    if work.context_bytes is not None:
        terms.append(Term("CUDA context", int(work.context_bytes), int(work.context_bytes), int(work.context_bytes),
                          "measured on the user's machine"))
    elif work.eager_loading:
        terms.append(Term("CUDA context", EAGER_CONTEXT, EAGER_CONTEXT, None,
                          "eager module loading: V100, CUDA 11.2 (Hugging Face perf_train_gpu_one); grows with "
                          "the libraries torch was built with", measured=False))
    else:
        context = card.cuda_context_bytes  # the Hopper cards': the H200's 526.8 MiB after init (gpus.py)
        source = _H200 if hopper else "hardware/gpus.py (the card's context, as sourced there)"
        name = "CUDA context"
        if vendor == "amd":
            name, source = "HIP context", "assumed: CUDA's typical context (no HIP context was measured; hardware/amd.py)"
        terms.append(Term(name, context, context, context, source, measured=hopper))
    if work.matmul:
        # eager loading loads every cuBLAS kernel at cublasCreate: more than the lazy figure, how much unknown
        terms.append(Term("rocBLAS/hipBLASLt" if vendor == "amd" else "cuBLAS/cuBLASLt", _CUBLAS, _CUBLAS,
                          None if work.eager_loading else _CUBLAS, where, measured=hopper and not work.eager_loading))
    if work.eager_loading:
        pass  # torch's own kernels (the step's, the forward's) were loaded with the context
    elif work.kind == "train":
        terms.append(Term("step kernels", _STEP_KERNELS, _STEP_KERNELS_LOW, _STEP_KERNELS_HIGH, where, measured=hopper))
    else:
        terms.append(Term("forward kernels", _FORWARD_KERNELS, _FORWARD_KERNELS_LOW, _FORWARD_KERNELS, where,
                          measured=hopper))
    if work.communicators:
        if work.world_size <= 1:
            each, low, high = _NCCL_LAZY_WORLD1, _NCCL_LAZY_WORLD1, _NCCL_EAGER
            note = "world size 1, made at the first collective"
        else:
            each, low, high = _NCCL_EAGER, _NCCL_LAZY_WORLD1, None
            note = "per communicator with peers: the eager world-1 figure; its channel buffers are not measured"
        n = int(work.communicators)
        terms.append(Term(f"NCCL ({n} communicator{'s' if n != 1 else ''})", n * each, n * low,
                          None if high is None else n * high, f"{where}; {note}", measured=hopper))
    if work.offload:
        terms.append(Term("CPU offload streams", _OFFLOAD, _OFFLOAD, _OFFLOAD, where, measured=hopper))
    return Outside(card.name, tuple(terms))
