"""Where a profile's memory came from: each storage's allocation site (the innermost frame of the user's
own code), the largest storages live at the peak with their stacks, and the leak finder.

Leaks (``leaks``): a storage allocated in step k that is still alive when the last step ends (so at least
one full step later) is a survivor of step k; survivors of steps 1 .. n-2 (0-based: step 0 makes what
lives for good, optimizer state and caches; the last step has no step after it) grouped by site, where at
least ``MIN_LEAK_STEPS`` steps left some, are leaks, with the bytes they add per step. A clean loop has none.
"""

from __future__ import annotations

import os
from bisect import bisect_right
from collections import Counter, defaultdict

from memfit.accounting.ledger import ALLOC, FREE, storage_events

__all__ = ["TOP", "FRAMES", "MIN_LEAK_STEPS", "short", "frames", "site", "largest_at", "leaks"]

TOP = 20  # largest allocations at the peak kept with their stacks
FRAMES = 12  # frames kept per allocation stack
MIN_LEAK_STEPS = 2


def short(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path


def frames(watch, index: int) -> list[str]:
    return [f"{short(f)}:{line} in {name}" for f, line, name in watch.stack(index)[0]]


def site(watch, index: int) -> str:
    """The innermost frame of the user's code that allocated record ``index`` ("file.py:LINE")."""
    stack, _ = watch.stack(index)
    if not stack:
        return "(before the profile)"
    return f"{short(stack[0][0])}:{stack[0][1]}"


def live_at(watch, stop: int | None) -> dict[int, None]:
    live: dict[int, None] = {}
    for number, (kind, index) in enumerate(storage_events(watch)):
        if stop is not None and number > stop:
            break
        if kind == ALLOC:
            live[index] = None
        elif kind == FREE:
            live.pop(index, None)
    return live


def largest_at(watch, event: int) -> list[dict]:
    live = live_at(watch, event)
    top = sorted(live, key=lambda i: -watch.records[i].nbytes)[:TOP]
    out = []
    for index in top:
        record = watch.records[index]
        out.append({"bytes": record.nbytes, "category": record.category.value, "module": record.module,
                    "site": site(watch, index), "stack": frames(watch, index)})
    return out


def leaks(watch, boundaries: list[int]) -> list[dict]:
    """Sites whose storages, made in step k, outlive step k + 1 and the profile (see the module docstring)."""
    steps = len(boundaries)
    if steps < 4:
        return []
    last = boundaries[-1]
    born_at: dict[int, int] = {}
    freed_at: dict[int, int] = {}
    for number, (kind, index) in enumerate(watch.events):
        if kind == ALLOC:
            born_at[index] = number
        elif kind == FREE:
            freed_at[index] = number

    by_site: dict[str, Counter] = defaultdict(Counter)
    category: dict[str, Counter] = defaultdict(Counter)
    example: dict[str, int] = {}
    for index, born in born_at.items():
        if freed_at.get(index, last) < last:
            continue  # freed before the last step ended
        record = watch.records[index]
        if record.donated or record.managed:
            continue
        k = bisect_right(boundaries, born)  # the step it was made in: the first boundary past it
        if not 1 <= k <= steps - 2:
            continue
        where = site(watch, index)
        by_site[where][k] += record.nbytes
        category[where][record.category.value] += record.nbytes
        example.setdefault(where, index)
    span = steps - 2
    found = []
    for where, per_step in by_site.items():
        if len(per_step) < MIN_LEAK_STEPS:
            continue
        found.append({"site": where, "bytes_per_step": round(sum(per_step.values()) / span),
                      "steps": len(per_step), "category": category[where].most_common(1)[0][0],
                      "stack": frames(watch, example[where])})
    return sorted(found, key=lambda leak: -leak["bytes_per_step"])
