"""Turn a ledger's event log into the numbers of a report.

One pass over the events keeps the live bytes, per category, and remembers the highest point of
the whole run and of every (step, phase). A second pass stops at the global peak to say which
modules created what was live there. Kernel scratch is a spike: live for the instant its op runs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import islice

from memfit.accounting.ledger import ALLOC, FREE, KEPT, MARK, RENAME, SPIKE, Ledger, managed_peak, storage_events
from memfit.categories import Category

__all__ = ["Replay", "replay", "LedgerView"]

TIMELINE_POINTS = 600


@dataclass
class Replay:
    peak_bytes: int
    peak_event: int
    by_category: dict[str, int]
    phase_peaks: dict[tuple[int, str], int]
    phase_categories: dict[tuple[int, str], dict[str, int]]
    modules: list[tuple[str, int]]
    timeline: list[tuple[int, int, str, int]]
    scratch_at_peak: int
    # the timeline's points by category: {"event", "phase", "step", "by_category": {category: [bytes]}}
    stacked: dict | None = None
    series: "Series | None" = None  # trace(detail=True)
    ops: list | None = None  # trace(detail=True): (mark, flops, bytes, dtype code) per kernel
    allocator: object = None  # CUDA semantics: the allocator model's AllocatorStats
    offloaded_bytes: int = 0  # trace(detail=True): activation bytes moved off the device
    offloaded_scaled: int = 0  # with a prime batch: the part of it that scales with the batch
    ledger: object = None  # trace(keep=True): the ledger replayed, and below the scratch of its sites
    scratch: list | None = None
    managed_bytes: int = 0  # highest live bytes of CUDA managed memory (not in peak_bytes)
    managed_resident: int = 0  # of it, what one parameter's update needs on the device at once


def replay(ledger: Ledger, scratch: list[int]) -> Replay:
    records, marks = ledger.records, ledger.marks
    live = 0
    by_cat: Counter = Counter()
    peak, peak_event, peak_cats, peak_scratch = -1, 0, {}, 0
    phase_peaks: dict[tuple[int, str], int] = {}
    phase_cats: dict[tuple[int, str], dict[str, int]] = {}
    where = ("setup", -1)
    series = []
    stride = max(1, -(-len(ledger.events) // TIMELINE_POINTS))
    stacked, best = [], (-1, None)
    for number, (kind, index) in enumerate(storage_events(ledger)):
        spike = 0
        if kind == ALLOC:
            record = records[index]
            live += record.nbytes
            by_cat[record.category.value] += record.nbytes
        elif kind == RENAME:  # takes over the donor's memory: moves category only
            record = records[index]
            by_cat[records[record.donor].category.value] -= record.nbytes
            by_cat[record.category.value] += record.nbytes
        elif kind == FREE:
            record = records[index]
            live -= record.nbytes
            by_cat[record.category.value] -= record.nbytes
        elif kind == SPIKE:
            spike = scratch[index]
        elif kind == MARK:
            where = marks[index]
        now = live + spike
        series.append((now, where))
        if number % stride == 0 and best[1] is not None:
            stacked.append(best)
            best = (-1, None)
        if now > best[0]:
            best = (now, (number, where, _with_spike(by_cat, spike)))
        key = (where[1], where[0])
        if now > phase_peaks.get(key, -1):
            phase_peaks[key] = now
            phase_cats[key] = _with_spike(by_cat, spike)
        if now > peak:
            peak, peak_event, peak_cats, peak_scratch = now, number, phase_cats[key], spike
    if best[1] is not None:
        stacked.append(best)
    modules = _modules_at(ledger, peak_event, scratch)
    managed, resident = managed_peak(ledger)
    return Replay(
        peak_bytes=max(peak, 0),
        peak_event=peak_event,
        by_category=peak_cats,
        phase_peaks=phase_peaks,
        phase_categories=phase_cats,
        modules=modules,
        timeline=_downsample(series),
        scratch_at_peak=peak_scratch,
        stacked=_stacked(stacked),
        managed_bytes=managed,
        managed_resident=resident,
    )


def _with_spike(by_cat: Counter, spike: int) -> dict[str, int]:
    cats = {c.value: by_cat.get(c.value, 0) for c in Category}
    cats[Category.TEMPORARIES.value] += spike
    return cats


def _stacked(points) -> dict:
    """The downsampled points (each the highest of its stretch) as columns, one per category."""
    cats = [c.value for c in Category]
    return {"event": [p[1][0] for p in points], "phase": [p[1][1][0] for p in points],
            "step": [p[1][1][1] for p in points],
            "by_category": {c: [p[1][2].get(c, 0) for p in points] for c in cats}}


def _modules_at(ledger: Ledger, stop: int, scratch) -> list[tuple[str, int]]:
    """Bytes of activations and temporaries live at event ``stop``, by the module that made them."""
    live: dict[int, None] = {}
    for kind, index in islice(storage_events(ledger), stop + 1):
        if kind == ALLOC:
            live[index] = None
        elif kind == RENAME:
            live[index] = None
            live.pop(ledger.records[index].donor, None)
        elif kind in (FREE, KEPT):
            live.pop(index, None)
    held: Counter = Counter()
    for index in live:
        record = ledger.records[index]
        if record.category in (Category.ACTIVATIONS, Category.TEMPORARIES):
            held[record.module] += record.nbytes
    kind, index = ledger.events[stop]
    if kind == SPIKE:
        held[ledger.sites[index].module] += scratch[index]
    return [(name, nbytes) for name, nbytes in held.most_common() if nbytes > 0]


def _downsample(series) -> list[tuple[int, int, str, int]]:
    """At most ``TIMELINE_POINTS`` points; each keeps the highest value of its stretch."""
    if not series:
        return []
    stride = max(1, -(-len(series) // TIMELINE_POINTS))
    points = []
    for start in range(0, len(series), stride):
        chunk = series[start : start + stride]
        offset = max(range(len(chunk)), key=lambda i: chunk[i][0])
        value, (phase, step) = chunk[offset]
        points.append((start + offset, value, phase, step))
    return points


@dataclass
class Series:
    """Live bytes after every event of a step, for lining up traces (the planner).

    live     all live bytes (kernel scratch as a spike at its event)
    grads    live bytes of storages that hold a gradient
    state    live bytes of optimizer state
    mark     index into ``marks`` of the (phase, step, micro-batch) each event belongs to
    scaled   with ``prime`` (the batch's row count): the part of ``live`` that scales with the
             batch (``Record.scaled``)
    """

    live: "object"
    grads: "object"
    state: "object"
    mark: "object"
    marks: list[tuple[str, int, int]]
    scaled: "object" = None


def event_series(ledger: Ledger, scratch: list[int], prime: int | None = None) -> Series:
    import numpy as np

    records = ledger.records
    marks, micro, seen = [], {}, {}
    for phase, step in ledger.marks:
        if phase == "forward":
            micro[step] = seen[step] = seen.get(step, -1) + 1
        marks.append((phase, step, micro.get(step, 0)))
    n = len(ledger.events)
    live, grads, state = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64)
    scaled = np.zeros(n, np.int64)
    mark = np.zeros(n, np.int32)
    total = g = s = p = 0
    where = 0
    gradients, optimizer_state = Category.GRADIENTS, Category.OPTIMIZER_STATE
    for number, (kind, index) in enumerate(storage_events(ledger)):
        spike = 0
        if kind in (ALLOC, FREE, RENAME, KEPT):
            record = records[index]
            sign = -1 if kind == FREE else 1
            if kind == RENAME:  # takes over the donor's memory
                delta = 0
                donor = records[record.donor]
                if donor.category is gradients:
                    g -= record.nbytes
                elif donor.category is optimizer_state:
                    s -= record.nbytes
            elif kind == KEPT:  # its memory lives on in another record
                delta = sign = 0
            else:
                delta = sign * record.nbytes
            total += delta
            if prime and delta:
                p += record.scaled if delta > 0 else -record.scaled
            if record.category is gradients:
                g += sign * record.nbytes
            elif record.category is optimizer_state:
                s += sign * record.nbytes
        elif kind == SPIKE:
            spike = scratch[index]
        elif kind == MARK:
            where = index
        live[number], grads[number], state[number], mark[number] = total + spike, g, s, where
        scaled[number] = p
    return Series(live, grads, state, mark, marks, scaled if prime else None)


class LedgerView:
    """A ledger's records with only some storages' events (``keep``, record indices): one device's side
    of a step on several (an offloaded step's GPU or host, a device_map's GPUs). Marks stay; kernel
    scratch (``spikes``) stays with one side. ``transient``: storages this side holds only for a moment (a
    tensor made here, then copied to the other side): each is freed right after it is allocated."""

    def __init__(self, ledger, keep: set[int], spikes: bool, transient: frozenset = frozenset()):
        self.records, self.marks, self.sites, self.model = ledger.records, ledger.marks, ledger.sites, ledger.model
        self.events = []
        for kind, i in ledger.events:
            if kind in (ALLOC, FREE) and i in transient:
                if kind == ALLOC:
                    self.events += [(ALLOC, i), (FREE, i)]
            elif (kind not in (ALLOC, FREE) or i in keep) and (spikes or kind != SPIKE):
                self.events.append((kind, i))
