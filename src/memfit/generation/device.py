"""A generation under CUDA semantics: the caching allocator's figures and the verdict on a card.

The trace itself follows CUDA's rules where they differ from the CPU's (``hardware/cuda.py``: the SDPA kernel
CUDA picks, no CPU kernel scratch) and the ledger adds the cuBLAS workspace of the one thread that runs the
matmuls (32 MiB on Hopper: the whole of the 1.04 % and 0.17 % a CPU-semantics estimate was below an H200's
``max_memory_allocated`` on a Llama-3.2-1B and a Qwen3-8B generate). The log is then replayed through the
caching-allocator model (``accounting/cuda_allocator.py``) exactly as a training step's is
(``estimator/verdict.cuda_fit``): 512-byte rounding, segments, ``max_memory_reserved``, and the verdict under the
card's memory less what a generating process holds outside the allocator (``hardware/outside.py``), or under a
budget.

The depth fast path (``fast.py``) traces the prefill with the first decode steps from the true prompt, and the
last decode step apart (from a longer prompt). The prefill's log is replayed as it is. Where the last decode step
holds the peak, its extra bytes above the prefill's are added to allocated and reserved (whole 2 MiB pages: a
growing cache takes fresh large-pool blocks), and the verdict is read from those figures; ``--full`` replays
every step.
"""

from __future__ import annotations

from memfit.estimator.verdict import EXPANDABLE, FITS, OOM, cuda_fit, outside_fields
from memfit.hardware.outside import Workload, outside

__all__ = ["cuda_fields"]

_PAGE = 2 * 1024 * 1024


def cuda_fields(log, gpu, budget: int | None, above: int = 0) -> tuple[dict, list[str]]:
    """(Report keyword arguments, notes) of ``log`` replayed on ``gpu``; ``above``: bytes the peak is higher than
    the log's own (a last decode step traced apart)."""
    found = outside(gpu, Workload(kind="generate"))
    fit = cuda_fit(log, gpu, budget, outside=found.bytes)
    fields = dict(fit.report_fields(), **outside_fields(found), gpu=gpu.name)
    notes = []
    if above > 0:
        extra = -(-above // _PAGE) * _PAGE
        fields["peak_bytes"] += above
        fields["reserved_bytes"] += extra
        capacity = fields["capacity_bytes"]
        if fields["verdict"] in (FITS, EXPANDABLE) and fields["reserved_bytes"] > capacity:
            fields["verdict"], fields["missing_bytes"] = OOM, fields["reserved_bytes"] - capacity
        notes.append("reserved: the prefill's allocator replay, plus the last decode step's bytes above it (traced "
                     "apart); --full replays every step")
    return fields, notes
