"""What the pictures (``pictures.py``) draw: a report's timeline on an x that two runs share.

An estimate and a measurement of the same step have different event counts (the estimate sees no
allocator-internal or Python-side allocations, a profile sees no fake-tensor bookkeeping), so no
picture draws on event numbers. Each point stands at ``step + its position inside its (step, phase)
segment``: step s takes [s, s+1) (what comes before step 1, the setup, takes [-SETUP_WIDTH, 0)), shared
between its phases in proportion to the events they span in the first report. A phase that runs
more than once in a step (forward and backward of each accumulated micro-batch) is one segment per run.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from memfit.report.report import Report

__all__ = ["Timeline", "timeline", "unit", "TOTAL", "SETUP_WIDTH"]

TOTAL = "live (total)"  # the one series of a report without ``stacked``
# Bottom to top: what lives the whole step under what comes and goes.
STACK_ORDER = ("parameters", "buffers", "unsharded_parameters", "gradients", "unsharded_gradients",
               "optimizer_state", "batch", "communication", "kv_cache", "activations", "temporaries")
SETUP_WIDTH = 0.3  # x taken by what happens before step 1 (a step takes 1)


@dataclass(frozen=True)
class Segment:
    key: tuple  # (step, phase, k): the k-th run of that phase within that step
    first: int  # event of its first point
    end: int  # event of the next segment's first point (one past the last point for the last)


@dataclass(frozen=True)
class Timeline:
    """What both pictures draw, in bytes, on the shared x."""
    x: list[float]
    series: dict[str, list[int]]  # category (or TOTAL) -> bytes at each x, bottom of the stack first
    where: list[str]  # each point's "step 2 backward, event 1234", for the hover
    bands: list[tuple[float, float, str]]  # (x0, x1, phase)
    steps: list[tuple[float, float, str]]  # (x0, x1, "step 1")
    peak: tuple[float, int]  # (x, bytes) of the highest point of ``series``
    estimate: tuple[list[float], list[int]] | None  # the other report's total
    reserved: tuple[list[float], list[int]] | None  # the allocator's reserved bytes (a CUDA profile)
    top: int  # the highest bytes drawn (reserved or the estimate can pass the peak)
    unit: tuple[str, float]  # ("GiB", 2**30): the y axis unit, chosen from ``top``


def timeline(report: Report, estimate: Report | None = None) -> Timeline:
    events, phases, steps, series = _points(report)
    runs = [_segments(events, phases, steps)]
    if estimate is not None:
        est_events, est_phases, est_steps, est_series = _points(estimate)
        runs.append(_segments(est_events, est_phases, est_steps))
    layout = _layout(runs)
    x = _xs(events, runs[0], layout)
    totals = [sum(col) for col in zip(*series.values())] or [0]
    at = max(range(len(totals)), key=totals.__getitem__)
    est = None
    if estimate is not None:
        est = (_xs(est_events, runs[1], layout), [sum(col) for col in zip(*est_series.values())])
    reserved = None
    if report.reserved and report.reserved.get("event") and runs[0]:
        reserved = (_xs(report.reserved["event"], runs[0], layout), list(report.reserved["bytes"]))
    top = max([totals[at], report.peak_bytes] + (est[1] if est else []) + (reserved[1] if reserved else []))
    return Timeline(
        x=x, series=series, where=[f"{_step_name(s)} {p}, event {e}" for e, p, s in zip(events, phases, steps)],
        bands=[(x0, x0 + w, key[1]) for key, (x0, w) in layout.items()],
        steps=[(-SETUP_WIDTH, 0.0, "setup") if s < 0 else
               (float(s), s + 1.0, "after" if {k[1] for k in layout if k[0] == s} == {"after"} else _step_name(s))
               for s in sorted({key[0] for key in layout})],
        peak=(x[at] if x else 0.0, totals[at]), estimate=est, reserved=reserved, top=top, unit=unit(top))


def unit(nbytes: int) -> tuple[str, float]:
    """The binary unit a y axis reaching ``nbytes`` reads best in, and its size."""
    for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return name, float(size)
    return "B", 1.0


def _step_name(step: int) -> str:
    return "setup" if step < 0 else f"step {step + 1}"  # steps are 0-based in the report, 1-based in words


def _points(report: Report) -> tuple[list, list, list, dict[str, list[int]]]:
    """events, phases, steps and bytes by category of the report's timeline (``stacked``; without it
    the ``timeline``'s total as the one series ``TOTAL``)."""
    if report.stacked:
        s = report.stacked
        cats = s["by_category"]
        names = [c for c in STACK_ORDER if c in cats] + [c for c in cats if c not in STACK_ORDER]
        return s["event"], s["phase"], s["step"], {c: cats[c] for c in names if any(cats[c])}
    rows = report.timeline or []
    return [r[0] for r in rows], [r[2] for r in rows], [r[3] for r in rows], {TOTAL: [r[1] for r in rows]}


def _segments(events, phases, steps) -> list[Segment]:
    """The runs of consecutive points of one (step, phase)."""
    starts, seen = [], Counter()
    for i, (event, phase, step) in enumerate(zip(events, phases, steps)):
        if i == 0 or (phase, step) != (phases[i - 1], steps[i - 1]):
            starts.append(((step, phase, seen[step, phase]), event))
            seen[step, phase] += 1
    ends = [event for _, event in starts[1:]] + ([events[-1] + 1] if events else [])
    return [Segment(key, first, end) for (key, first), end in zip(starts, ends)]


def _merged(runs: list[list[Segment]]) -> list[tuple]:
    """The segment keys of all runs in one order: the first run's, each other key after its predecessor."""
    out = [seg.key for seg in runs[0]]
    for run in runs[1:]:
        at = 0
        for seg in run:
            if seg.key in out:
                at = out.index(seg.key) + 1
            else:
                out.insert(at, seg.key)
                at += 1
    return sorted(out, key=lambda key: key[0])  # stable: each step's segments stay in order


def _layout(runs: list[list[Segment]]) -> dict[tuple, tuple[float, float]]:
    """(x0, width) of every segment of every run (module docstring)."""
    share: dict[tuple, float] = {}
    for run in reversed(runs):  # the first run's shares win
        spans = Counter()
        for seg in run:
            spans[seg.key[0]] += seg.end - seg.first
        share.update({seg.key: (seg.end - seg.first) / max(spans[seg.key[0]], 1) for seg in run})
    by_step: dict[int, list[tuple]] = {}
    for key in _merged(runs):
        by_step.setdefault(key[0], []).append(key)
    out = {}
    for step, keys in by_step.items():
        x, width = (float(step), 1.0) if step >= 0 else (-SETUP_WIDTH, SETUP_WIDTH)
        total = sum(share[k] for k in keys) or 1.0
        for key in keys:
            out[key] = (x, width * share[key] / total)
            x += out[key][1]
    return out


def _xs(events, segments: list[Segment], layout) -> list[float]:
    """Each event's x: its segment's start plus its position inside the segment."""
    out, i = [], 0
    for event in events:
        while i + 1 < len(segments) and segments[i + 1].first <= event:
            i += 1
        while i > 0 and segments[i].first > event:  # events out of order (a reserved series): step back
            i -= 1
        seg = segments[i]
        x0, width = layout[seg.key]
        out.append(x0 + width * min(max((event - seg.first) / max(seg.end - seg.first, 1), 0.0), 1.0))
    return out
