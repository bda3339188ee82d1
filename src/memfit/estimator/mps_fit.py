"""Whether a training step fits on a Mac: MPS's heaps replayed under its watermarks, and the answer a Mac gives.

A Mac does not run out of GPU memory where a card does: past Metal's recommended working set macOS gives the GPU more
of the shared RAM and swaps what else lived there, and only past MPS's high watermark (1.7 x the working set by
default, ``PYTORCH_MPS_HIGH_WATERMARK_RATIO``) does an allocation fail (``hardware/mps.py``). So the verdict has three
words: ``fits`` (the heaps stay within the working set), ``fits_by_swapping`` (past it by ``missing_bytes``: the run
goes on, slower as macOS swaps), ``out_of_memory`` (past the high watermark by ``missing_bytes``). A ``budget`` is
``torch.mps.set_per_process_memory_fraction(budget / working set)``: the high watermark at the budget.

The replay is ``accounting/mps_heaps.py``'s. What MPSGraph and Metal hold beside the heaps is not counted (0 bytes,
marked assumed by ``hardware/outside.py``). The error margin is CUDA's measured one: nothing was measured on a Mac.
"""

from __future__ import annotations

from memfit.accounting.mps_heaps import replay_mps
from memfit.hardware.mps import MpsLimits, environment_limits, memory_fraction, verdict
from memfit.report.report import OOM

__all__ = ["mps_fit"]


def mps_fit(ledger, mac, budget: int | None = None) -> dict:
    """The fields of the ``CudaFit`` (``estimator/verdict.py`` makes it) of ``ledger`` on ``mac``, on a Mac's terms:
    ``reserved`` is the heaps held, ``capacity_bytes`` the working set (or a smaller budget)."""
    working = mac.working_set_bytes
    watermarks = environment_limits(working)  # PYTORCH_MPS_*_WATERMARK_RATIO as this process's environment sets them
    high = watermarks.high
    if budget is not None:  # set_per_process_memory_fraction(budget / working set): the high watermark at the budget
        memory_fraction(budget, working)
        high = budget
    unlimited, _ = replay_mps(ledger, None, watermarks.low)
    limited = high is not None and unlimited.peak_held > min(high, working)  # high None: the ratio 0.0, no limit
    stats, oom = replay_mps(ledger, high, watermarks.low) if limited else (unlimited, None)
    capacity = working if high is None else min(working, high)
    if oom is not None:  # the replay under the limit failed, after freeing every cache
        word, missing, held = OOM, unlimited.peak_held - high, oom.held
    else:  # it ran: within the working set, or past it (swapping)
        word, past = verdict(stats.peak_held, MpsLimits(working, high, watermarks.low))
        missing, held = past or None, stats.peak_held
    allocated = unlimited.peak_allocated if oom is not None else stats.peak_allocated
    return dict(verdict=word, gpu=mac.name, capacity_bytes=capacity, budget_bytes=budget, allocated=allocated,
                reserved=held, retries=stats.cache_releases, missing_bytes=missing, replayed=True, unlimited=None)
