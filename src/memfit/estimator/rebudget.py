"""A budgeted estimate from an unbudgeted one: the allocator replayed under the budget, not traced again.

A ``budget`` matters only after the trace: ``trace`` replays the ledger's events through the caching
allocator under the limit (``verdict.cuda_fit``) and the Report's verdict fields come from that replay
(``CudaFit.report_fields``); every other field (the replay of the log, the phases, the settings, the
notes, what is outside the allocator) is the same with any budget. So where an estimate was one plain
trace on one device, the same estimate under a budget is that report with its verdict fields replaced
by a replay of the same events under the budget.

``recording()`` collects what ``trace`` offers (``offer``: the device's events, the card, what is
outside the allocator, the unlimited allocator statistics) while an estimate runs; ``replayable``
says whether the estimate was that one trace and nothing else, and ``rebudgeted`` makes the budgeted
report. An estimate is *not* one plain trace, and its paths say so (``spoil``), where its report's
fields come from elsewhere or depend on the budget in other ways: the depth fast path (a shallow
trace, its log written out at full depth and replayed there), accumulation read off a line (two
traces, a verdict from a reserved figure, and near the limit a full trace), multi-rank estimates,
device_map placements (per-device verdicts), and an offloaded step (its GPU's side is a view of
the ledger; ``trace`` does not offer it). Variable-length data traces one shape each: more than one
offer is not replayable either. The planner uses it (``planner/compose.py``: ``Engine.verify``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass, field

__all__ = ["Replay", "recording", "offer", "spoil", "replayable", "rebudgeted"]


@dataclass(frozen=True)
class Replay:
    """What replaying one trace's allocator under another budget needs, and nothing more: the ledger's
    records and events (no model, no probe sites, no tensors), the card, the bytes outside the allocator,
    the unlimited statistics (so each budget replays only the limited runs) and the verdict fields the
    trace reported (checked against the report: ``replayable``)."""

    records: list
    events: list
    gpu: object
    outside: int
    unlimited: object
    fields: dict


@dataclass
class _Recording:
    offers: list = field(default_factory=list)
    spoiled: list = field(default_factory=list)  # why the estimate is not one plain trace


_ACTIVE: contextvars.ContextVar[_Recording | None] = contextvars.ContextVar("memfit_rebudget", default=None)


@contextlib.contextmanager
def recording():
    """Collect, while an estimate runs inside, what its traces offer for a replay under another budget."""
    found = _Recording()
    token = _ACTIVE.set(found)
    try:
        yield found
    finally:
        _ACTIVE.reset(token)


def offer(ledger, gpu, outside: int, verdict) -> None:
    """From ``trace``: one device's step, its ``verdict`` (a ``CudaFit``) replayed from ``ledger``. Kept only
    inside ``recording()`` (nothing is kept otherwise)."""
    found = _ACTIVE.get()
    if found is not None:
        found.offers.append(Replay(ledger.records, ledger.events, gpu, outside, verdict.unlimited,
                                   verdict.report_fields()))


def spoil(why: str) -> None:
    """From a path whose report is not one plain trace's (module docstring): no replay of this estimate."""
    found = _ACTIVE.get()
    if found is not None:
        found.spoiled.append(why)


def replayable(found: _Recording, report) -> Replay | None:
    """The replay of an estimate made inside ``recording()``, if it was one plain trace whose verdict is the
    report's; else None (then a budget needs the full estimate)."""
    if found.spoiled or len(found.offers) != 1:
        return None
    one = found.offers[0]
    if any(getattr(report, name) != value for name, value in one.fields.items()):
        return None  # the report's verdict is not that trace's: something after it changed it
    return one


def rebudgeted(report, replay: Replay, budget: int | None):
    """``report`` (the estimate ``replay`` was recorded with) as the same estimate under ``budget`` makes it:
    its verdict fields from the allocator replayed under the budget, every other field as it is."""
    from memfit.estimator.verdict import cuda_fit

    verdict = cuda_fit(replay, replay.gpu, budget, outside=replay.outside, unlimited=replay.unlimited)
    return dataclasses.replace(report, **verdict.report_fields())
