"""Independent truth on CPU: the allocator's own events, read through ``torch.profiler``.

This is what estimates are graded against in tests and bench/. It shares nothing with the
ledger: ``profile(profile_memory=True)`` records every allocation and free the CPU allocator
serves (kernel scratch included), and the peak is the highest running sum of those events.
``prof.events()`` alone misses frees, so the kineto event tree is walked instead.
"""

from __future__ import annotations

from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

__all__ = ["allocator_peak"]


def allocator_peak(fn) -> int:
    """Highest bytes allocated above the level at entry while ``fn()`` runs on CPU."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    found = []

    def walk(event):
        if event.tag == _EventType.Allocation:
            found.append((event.start_time_ns, event.extra_fields.alloc_size))
        for child in event.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    running = peak = 0
    for _, size in sorted(found, key=lambda item: item[0]):
        running += size
        peak = max(peak, running)
    return peak
