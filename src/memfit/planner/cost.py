"""Step time from the kernels of a trace: a roofline per kernel, plus launch and host-link costs.

Each kernel row of a traced step (``accounting/ops.py``: FLOPs, bytes moved, math dtype) takes
``max(flops / matmul rate, bytes / memory bandwidth) + launch`` seconds: a matmul is bound by the
tensor cores, everything else by memory, and eager PyTorch pays a fixed cost per kernel. Activation
offload adds its bytes over the host link twice (out after forward, back for backward; the copies
are synchronous in ``techniques/offload_activations.py``). The planner sums these per micro-batch and adds the
optimizer's kernels. Paged optimizer state (bitsandbytes, CUDA managed memory) that does not fit
on the card beside the allocator's reserved memory is evicted to the host and brought back each
step: ``paging_seconds`` charges those bytes over the host link both ways (``estimator/verdict.py``
says which part pages).

Rates: for a catalog GPU, its datasheet peaks (``gpus.py``) times the fraction eager PyTorch
reaches (``EFFICIENCY``, checked against the H100 runs recorded in ``bench/results``; see
``bench/gpu/plan_calibrate.py``); for the CPU, measured on this machine at first use
(``Speed.host()``: a 1024^3 matmul per dtype, a 64 MiB copy, and the per-kernel cost of a
training step of tiny modules: dispatch, module calls and autograd).

Written by hand: torch's ``FlopCounterMode`` counts FLOPs only, and no library we know predicts
eager step time per kernel from a fake trace.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Speed", "EFFICIENCY"]

#: Fraction of datasheet peak eager PyTorch reaches: large bf16/fp16 GEMMs, fp32 (non-tensor) GEMMs,
#: DRAM streaming, and the fixed cost of one kernel (CPU-side dispatch of an eager op).
EFFICIENCY = {"matmul": 0.70, "bandwidth": 0.80, "launch_seconds": 8e-6, "host_link": 0.80}


@dataclass(frozen=True)
class Speed:
    """Rates of one device: matmul FLOP/s per dtype code (0 fp32, 1 bf16, 2 fp16), bytes/s."""

    name: str
    matmul: tuple[float, float, float]
    bandwidth: float
    launch_seconds: float
    host_link: float  # bytes/s each way; 0 where there is no separate host memory

    @classmethod
    def from_gpu(cls, gpu) -> "Speed":
        e = EFFICIENCY
        return cls(gpu.name, (gpu.fp32_flops * e["matmul"], gpu.bf16_flops * e["matmul"], gpu.fp16_flops * e["matmul"]),
                   gpu.memory_bandwidth * e["bandwidth"], e["launch_seconds"], gpu.host_link_bandwidth * e["host_link"])

    @classmethod
    def host(cls) -> "Speed":
        """This machine's CPU, measured once per process (about half a second)."""
        return _host()

    def kernel_seconds(self, rows) -> float:
        """Seconds of kernel rows ``(flops, bytes, dtype code)`` (an ``N x 3`` array)."""
        rows = np.asarray(rows, dtype=np.float64).reshape(-1, 3)
        if not len(rows):
            return 0.0
        rate = np.asarray(self.matmul)[rows[:, 2].astype(np.int64)]
        return float(np.maximum(rows[:, 0] / rate, rows[:, 1] / self.bandwidth).sum() + len(rows) * self.launch_seconds)

    def transfer_seconds(self, nbytes: float) -> float:
        return nbytes / self.host_link if self.host_link else 0.0

    def paging_seconds(self, paged: float) -> float:
        """Seconds a step spends paging ``paged`` bytes of managed memory: in before their update,
        out (written back, the update dirtied them) to make room for the next ones."""
        return 2 * self.transfer_seconds(max(paged, 0.0))


def _timed(fn, repeat: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@functools.lru_cache(maxsize=1)
def _host() -> Speed:
    n = 1024
    rates = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        rates.append(2 * n**3 / _timed(lambda: a @ b))
    src = torch.empty(16 * 1024**2)  # 64 MiB
    dst = torch.empty_like(src)
    bandwidth = 2 * src.nbytes / _timed(lambda: dst.copy_(src))
    launch = _step_overhead()
    return Speed("cpu", tuple(rates), bandwidth, launch, 0.0)


def _step_overhead() -> float:
    """Seconds per kernel of a training step whose kernels do almost nothing: module calls,
    dispatch and autograd bookkeeping (four tiny LayerNorm-Linear-GELU blocks, forward and
    backward). A bare op costs a third of this; a step pays it on every kernel."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from memfit.accounting.ops import OpCounter

    class _Marks:
        marks = [("step", 0, 0)]

    class _Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counter = OpCounter(_Marks())

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.counter.record(func, args, kwargs or {}, out)
            return out

    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 16),
                                                      torch.nn.GELU()) for _ in range(4)])
    x = torch.randn(4, 16)

    def step():
        model(x).sum().backward()

    counter = _Count()
    with counter:
        step()
    return _timed(lambda: [step() for _ in range(50)]) / 50 / len(counter.counter.rows)
