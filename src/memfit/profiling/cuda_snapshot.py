"""Reading torch's CUDA allocator snapshot (``torch.cuda.memory._snapshot()``).

The snapshot is PyTorch's own record of the caching allocator: ``segments`` (what is reserved now)
and ``device_traces`` (one list per device of events: ``alloc``, ``free_requested``,
``free_completed``, ``segment_alloc``, ``segment_free``, ``segment_map``, ``segment_unmap``, ``oom``,
each with ``addr``, ``size``, ``stream`` and ``frames``). memfit keeps it raw (``save``: the pickle
PyTorch's memory_viz page opens) and reads two things out of it: reserved bytes over time, and the
allocated peak, which must equal ``torch.cuda.max_memory_allocated`` over the same window.

Why by hand: torch ships the snapshot and a viewer, but no function that turns the trace into a
series (``torch.cuda._memory_viz`` draws it in JavaScript).
"""

from __future__ import annotations

import pickle
from pathlib import Path

__all__ = ["reserved_series", "allocated_peak", "save"]

_POINTS = 600


def _events(snapshot: dict, device: int | None = None) -> list[dict]:
    traces = snapshot.get("device_traces") or []
    if device is None:  # the device with the most events
        device = max(range(len(traces)), key=lambda d: len(traces[d]), default=0)
    return traces[device] if device < len(traces) else []


def _running(events, grows: set, shrinks: set) -> list[tuple[int, int]]:
    total, out = 0, []
    for number, event in enumerate(events):
        action = event.get("action")
        if action in grows:
            total += int(event.get("size", 0))
        elif action in shrinks:
            total -= int(event.get("size", 0))
        else:
            continue
        out.append((number, total))
    return out


def reserved_series(snapshot: dict, device: int | None = None) -> dict:
    """``{"event": [...], "bytes": [...]}``: reserved bytes after each segment event of the trace (at most
    600 points, each the highest of its stretch), counted from the start of the recording."""
    points = _running(_events(snapshot, device), {"segment_alloc", "segment_map"}, {"segment_free", "segment_unmap"})
    stride = max(1, -(-len(points) // _POINTS))
    kept = [max(points[i:i + stride], key=lambda p: p[1]) for i in range(0, len(points), stride)]
    return {"event": [p[0] for p in kept], "bytes": [p[1] for p in kept]}


def allocated_peak(snapshot: dict, device: int | None = None) -> int:
    """The highest allocated bytes over the trace, counted from the start of the recording (a block's
    memory returns at ``free_completed``, as ``max_memory_allocated`` counts it)."""
    points = _running(_events(snapshot, device), {"alloc"}, {"free_completed"})
    return max((p[1] for p in points), default=0)


def save(snapshot: dict, path) -> Path:
    """Write the snapshot as PyTorch's memory_viz page opens it (a pickle)."""
    path = Path(path)
    with open(path, "wb") as out:
        pickle.dump(snapshot, out)
    return path
