"""The CPU allocator's own events, read from a ``torch.profiler`` run with ``profile_memory``.

Shared by the independent truth (``memfit.truth``) and the kernel-scratch replays
(``scratch.py``): both need the allocations and frees under some profiler event, in time order,
and the highest running total they reach. ``prof.events()`` alone misses frees, so the kineto
event tree is walked.
"""

from __future__ import annotations

from torch._C._profiler import _EventType

__all__ = ["allocation_sizes", "span"]


def allocation_sizes(*events) -> list[int]:
    """Signed sizes of every allocation (+) and free (-) under ``events``, in time order."""
    found = []

    def walk(node):
        if node.tag == _EventType.Allocation:
            found.append((node.start_time_ns, node.extra_fields.alloc_size))
        for child in node.children:
            walk(child)

    for event in events:
        walk(event)
    return [size for _, size in sorted(found, key=lambda item: item[0])]


def span(sizes) -> tuple[int, int]:
    """(highest running total, final total) of a sequence of signed sizes, starting from 0."""
    running = peak = 0
    for size in sizes:
        running += size
        peak = max(peak, running)
    return peak, running
