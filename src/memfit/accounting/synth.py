"""The event log of a deep model, written from the log of a shallow copy of it.

The depth fast path traces a copy of the model with ``T`` repeated blocks (units) and needs what
the allocator model and the replay say for the real depth ``U``. Both are functions of the whole
ordered stream of allocations and frees, and the caching allocator is not linear in depth (which
segments a free block can serve depends on everything before it), so the stream itself is written
out at full depth and replayed, rather than its figures extrapolated.

Every event of the shallow log gets a *label*: the unit it runs for. An allocation's unit is that
of its record (the block whose module made it, else the block of the tensor it derives from: the
ledger's ``Record.owner``); a free's is the block running when it happened (``Record.freed_in``),
else its record's; marks and everything else belong to no unit. Records made outside any module
that derive from nothing (a per-parameter ``step`` counter) take the unit of the next event that
has one. Three kinds of event are moved into the stretch of the block they run in: autograd's own
ops between a block's ops (a checkpoint unpacking the block's input, derived from the previous
block's output), a block's activations freed by the stack's parent once the next block has run
(activation offload), and the free of a neighbouring block's temporary among a block's optimizer
ops (a per-parameter loop, CPU AdamW's default, frees the previous parameter's temporary when the
next one's replaces it). Then the log is cut into maximal runs of one label and written out in order:
a run of no unit once, a run of the first units once, a run of the middle unit ``T - 2`` once for
each of the full units ``T - 2 .. U - 2`` (last to first where the blocks around it run that way,
as in backward), and a run of the last unit as unit ``U - 1``. Forward and backward are one run
per block; an optimizer's foreach op over all parameters is one run per block within the op, so
its copies come out in parameter order as they would in the deep model.

A record is named by (stack, full unit, key), the key being its module path without the block
index, its phase and step, and its rank among the records of that unit with the same path, phase
and step. An event in unit ``t`` (written as full unit ``K``) that references a record of unit
``r`` of the same stack references full unit ``K + r - t``: the previous block's hidden state, freed
in the next block's forward, is the previous copy's. In-place accumulation (``Record.donor``) moves
the donor's name to the new record, as the allocator model does with its block.

Why by hand: nothing in torch writes an allocation trace for a model it did not run.
``tests/test_depth.py`` checks the result against full traces, and ``bench/speed/fast_vs_full.py``
against full traces of catalog models.

Known limitations: a free whose record cannot be named in the deep model (a shallow-model
coincidence) is dropped and counted in ``Synthesis.unmatched``; blocks that differ from each other
other than by a period (``unit``: alternating layer kinds, ``checkpointing=blocks:N``) are written
as copies of the middle one; a few small set-up tensors whose count depends on the depth itself
(peft's, 8 and 64 bytes) are those of the shallow copy; frees the garbage collector makes in an
arbitrary order come out in block order.
"""

from __future__ import annotations

from collections import Counter
from difflib import SequenceMatcher
from dataclasses import dataclass, field, replace

from memfit.accounting.ledger import ALLOC, FREE, MARK, OUTSIDE, SPIKE
from memfit.categories import Category

__all__ = ["Synthesis", "synthesise"]

_INHERIT = "inherit"  # label of an event whose unit is read from the next event that has one


@dataclass
class Synthesis:
    """A ledger-shaped log (``records``, ``events``, ``marks``, ``sites``) of the deep model:
    ``replay`` and ``cuda.allocator_stats`` take it as they take a ``Ledger``."""

    records: list
    events: list
    marks: list
    sites: list
    units: int  # repeated units of the deep model, per stack
    dropped: list = field(default_factory=list)  # shallow-log events (frees, donors) with no record to name
    parse: object = field(default=None, repr=False)  # module path -> (stack, unit, rest) or None
    template: dict = field(default_factory=dict)  # stack -> units of the shallow copy

    @property
    def unmatched(self) -> int:
        return len(self.dropped)

    def copies(self, path: str) -> int:
        """How many times what module ``path`` of the shallow copy holds is written in the deep model."""
        where = self.parse(path)
        return 1 if where is None else len(_full_units(where[1], self.template[where[0]], self.units))


def _parser(blocks: list[str], unit: int):
    """path -> (stack, unit, (block within the unit, path below the block)), or None outside every block."""
    prefixes = [(stack, stack + ".") for stack in blocks]
    cache: dict = {}

    def parse(path):
        if path is None:
            return None
        if path in cache:
            return cache[path]
        found = None
        for stack, prefix in prefixes:
            if path.startswith(prefix):
                index, _, tail = path[len(prefix):].partition(".")
                if index.isdigit():
                    block = int(index)
                    found = (stack, block // unit, (block % unit, tail))
                    break
        cache[path] = found
        return found
    return parse


def synthesise(ledger, *, depth: int, unit: int = 1) -> Synthesis:
    """The log ``ledger`` (a trace of ``T * unit`` blocks per stack) would have at ``depth`` blocks."""
    if depth % unit:
        raise ValueError(f"{depth} blocks do not split into units of {unit}")
    parse = _parser(ledger.blocks, unit)
    records = ledger.records
    where = [parse(r.module if r.module != OUTSIDE else r.owner) for r in records]
    home = [None if w is None else w[:2] for w in where]
    for i, r in enumerate(records):
        if r.module == OUTSIDE and r.owner is None:
            home[i] = _INHERIT
    labels = _labels(ledger, home, parse)
    for number, (kind, index) in enumerate(ledger.events):
        if kind == ALLOC and home[index] is _INHERIT:  # a made-from-nothing record's unit
            home[index] = labels[number]
        elif kind == FREE and parse(records[index].freed_in) is None:  # freed outside every block
            labels[number] = home[index]
    _absorb(ledger, labels, home, parse)
    template = _template_units(home)
    keys = _keys(records, home, where)
    roles = _Roles(records, home, keys, parse)
    log = _write(ledger, labels, home, where, keys, template, depth // unit, unit, roles)
    if log.dropped:  # a second naming, from the other end of each unit's records; kept when it places more frees
        again = _write(ledger, labels, home, where, _keys_from_the_end(records, home, keys), template, depth // unit,
                       unit, roles)
        log = again if len(again.dropped) < len(log.dropped) else log
    log.parse, log.template = parse, template
    return log


def _labels(ledger, home, parse) -> list:
    records = ledger.records
    labels = []
    for kind, index in ledger.events:
        if kind == ALLOC:
            labels.append(home[index])
        elif kind == FREE:
            running = parse(records[index].freed_in)
            labels.append(running[:2] if running is not None else home[index])
        elif kind == SPIKE:
            site = parse(ledger.sites[index].module)
            labels.append(None if site is None else site[:2])
        else:
            labels.append(None)
    # A label read from the next event that has one (a per-parameter step counter is made just
    # before its parameter's moments).
    after = None
    for n in range(len(labels) - 1, -1, -1):
        if labels[n] is _INHERIT:
            labels[n] = after
        else:
            after = labels[n]
    return labels


def _absorb(ledger, labels, home, parse) -> None:
    """A stretch of ops made outside any module inside another unit's stretch runs for that unit.

    Autograd's own ops in a block's backward (a checkpoint unpacking the block's input, made from
    the previous block's output) derive their owner from that input; they run between the events
    of the block, and cutting its stretch there would write the copies of its two halves apart."""
    records, events = ledger.records, ledger.events

    def loose(number):
        """Made, or freed, outside any module (optimizer steps are all loose: nothing to absorb)."""
        kind, index = events[number]
        if kind == ALLOC:
            return records[index].module == OUTSIDE
        return kind == FREE and parse(records[index].freed_in) is None

    def between(number, before):
        """A record of the block before ``before``, freed by the stack's parent module once ``before``
        has run (activation offload moves it out then): it belongs to ``before``'s stretch."""
        kind, index = events[number]
        if kind != FREE or home[index] != (before[0], before[1] - 1):
            return False
        freed_in = records[index].freed_in
        return freed_in is not None and freed_in != OUTSIDE and parse(freed_in) is None

    phases, phase = [], None
    for kind, index in events:
        if kind == MARK:
            phase = ledger.marks[index][0]
        phases.append(phase)

    def neighbour(number, around):
        """A loose free of a record of the unit next to ``around``, between two stretches of ``around``:
        a per-parameter optimizer loop (``foreach=False``, the CPU default) frees the previous
        parameter's temporary when the next parameter's replaces it, so the last one of a block
        is freed among the first ops of the next block. It belongs to that block's stretch
        (written per copy, it names the previous copy's record); cut there, the stretch's two
        halves would be written apart. Optimizer ops are all loose, so the rule above skips them.
        Only in the optimizer phase: elsewhere a loose free is the garbage collector's, at no fixed
        point (moving those made the fast path's figure vary from run to run with selective
        checkpointing on a GPU target). And a collective's buffer (FSDP2's reduce-scatter output),
        freed when the next unit's reduce-scatter starts: at a pipeline stage's last backward the root
        reduces every unit in turn, each freeing the one before's buffer among its own ops (cut there,
        the units' freed weights came out all first, then their reductions)."""
        kind, index = events[number]
        if kind != FREE or not loose(number) or not isinstance(around, tuple):
            return False
        if phases[number] != "optimizer" and records[index].category != Category.COMMUNICATION:
            return False
        label = home[index]
        return isinstance(label, tuple) and label[0] == around[0] and abs(label[1] - around[1]) == 1

    runs, number = [], 0
    while number < len(labels):
        end = number
        while end < len(labels) and labels[end] == labels[number]:
            end += 1
        runs.append((number, end))
        number = end
    for at in range(1, len(runs) - 1):
        (start, end), before, after = runs[at], labels[runs[at - 1][0]], labels[runs[at + 1][0]]
        anchored = all(not all(loose(n) for n in range(*runs[side])) for side in (at - 1, at + 1))
        if before == after and before != labels[start] and anchored and all(loose(n) for n in range(start, end)):
            for n in range(start, end):
                labels[n] = before
        elif before == after and all(neighbour(n, before) for n in range(start, end)):
            for n in range(start, end):
                labels[n] = before
        elif isinstance(before, tuple) and all(between(n, before) for n in range(start, end)):
            for n in range(start, end):
                labels[n] = before


def _template_units(home) -> dict:
    units: dict = {}
    for label in home:
        if isinstance(label, tuple):
            units[label[0]] = max(units.get(label[0], 0), label[1] + 1)
    return units


def _keys(records, home, where) -> list:
    keys, seen = [None] * len(records), Counter()
    for i, r in enumerate(records):
        if isinstance(home[i], tuple):
            path = where[i][2] if where[i] is not None and where[i][:2] == home[i] else r.module
            base = (home[i], path, r.phase, r.step)
            keys[i] = (path, r.phase, r.step, seen[base])
            seen[base] += 1
    return keys


def _keys_from_the_end(records, home, keys) -> list:
    """Each record's key with its rank counted from the last record of its unit with the same path, phase and step:
    a unit that holds one more such record than its neighbours (the first block of a pipeline stage's backward
    gathering its own weights beside its neighbour's prefetch) names the shared ones alike from this end."""
    total = Counter((home[i], k[:3]) for i, k in enumerate(keys) if k is not None)
    return [None if k is None else (*k[:3], "end", total[(home[i], k[:3])] - 1 - k[3]) for i, k in enumerate(keys)]


class _Roles:
    """Which record of another unit of the shallow copy plays the part a record plays in its own.

    An event of unit ``t`` written as full unit ``K`` that references a record of unit ``r`` references full unit
    ``K + r - t``, which the written log may write from another unit of the copy than ``r``: in a pipeline stage's
    backward the middle unit, written as full unit 4, frees the all-gather output FSDP2 prefetched for it in unit 5's
    backward, and unit 5 is written from the copy's middle unit, not from its last one, which gathers its own weights
    too (two more records before the prefetch). The record wanted is the one of the writing unit in the same place of
    the unit's sequence of records, matched by (path, phase, step, owner within the unit, bytes)."""

    def __init__(self, records, home, keys, parse):
        self.records, self.home, self.keys, self.parse = records, home, keys, parse
        self.members: dict = {}
        for i, label in enumerate(home):
            if isinstance(label, tuple) and keys[i] is not None:
                self.members.setdefault(label, []).append(i)
        self.pairs: dict = {}

    def _signature(self, i):
        record = self.records[i]
        owner = self.parse(record.owner)
        return (self.keys[i][:3], owner[2] if owner is not None and owner[:2] == self.home[i] else record.owner,
                record.nbytes, record.category)

    def counterpart(self, index: int, unit: int) -> int | None:
        """The record of ``unit`` (same stack) in ``index``'s place, or None when the two sequences differ there."""
        stack, r = self.home[index]
        pair = (stack, r, unit)
        if pair not in self.pairs:
            mine, theirs = self.members.get((stack, r), []), self.members.get((stack, unit), [])
            matcher = SequenceMatcher(None, [self._signature(i) for i in mine], [self._signature(j) for j in theirs],
                                      autojunk=False)
            self.pairs[pair] = {mine[a + k]: theirs[b + k] for a, b, size in matcher.get_matching_blocks()
                                for k in range(size)}
        return self.pairs[pair].get(index)


def _writer(t: int, template: int, units: int) -> int:
    """The unit of the shallow copy that writes full unit ``t`` (inverse of ``_full_units``)."""
    if t < template - 2:
        return t
    return template - 2 if t < units - 1 else template - 1


def _full_units(t: int, template: int, units: int) -> range:
    if t < template - 2:
        return range(t, t + 1)
    if t == template - 2:
        return range(t, units - 1)
    return range(units - 1, units)


def _write(ledger, labels, home, where, keys, template, units, unit, roles=None) -> Synthesis:
    records = ledger.records
    out_records, out_events = [], []
    live: dict = {}
    dropped = []

    def name(index, context):
        """The deep model's name of template record ``index``, seen from ``context`` (stack, t, K)."""
        label = home[index]
        if not isinstance(label, tuple):
            return ("x", index)
        stack, r = label
        if context is not None and context[0] == stack:
            full = context[2] + r - context[1]
            writer = _writer(full, template[stack], units)
            if roles is not None and writer != r and 0 <= full < units:
                found = roles.counterpart(index, writer)
                index = index if found is None else found
        else:
            full = _full_units(r, template[stack], units)[0]
        return (stack, full, keys[index])

    def emit(number, context):
        kind, index = ledger.events[number]
        if kind == ALLOC:
            record = records[index]
            donor = None
            if record.donor is not None:  # its free comes later and releases nothing
                donor = live.get(name(record.donor, context))
                if donor is None:
                    dropped.append(number)
            me = name(index, context)
            out_records.append(_renamed(record, donor, where[index], me, unit))
            live[me] = len(out_records) - 1
            out_events.append((ALLOC, len(out_records) - 1))
        elif kind == FREE:
            me = live.pop(name(index, context), None)
            if me is None:
                dropped.append(number)
            else:
                out_events.append((FREE, me))
        else:
            out_events.append((kind, index))

    runs, number, events = [], 0, ledger.events
    while number < len(events):
        end = number
        while end < len(events) and labels[end] == labels[number]:
            end += 1
        runs.append((number, end, labels[number]))
        number = end
    for at, (start, end, label) in enumerate(runs):
        if isinstance(label, tuple):
            stack, t = label
            fulls = _full_units(t, template[stack], units)
            for full in (reversed(fulls) if _descending(runs, at) else fulls):
                for n in range(start, end):
                    emit(n, (stack, t, full))
        else:
            for n in range(start, end):
                emit(n, None)
    return Synthesis(out_records, out_events, ledger.marks, ledger.sites, units, dropped)


def _descending(runs, at) -> bool:
    """Whether the blocks run last to first here (backward): the nearest run of another unit of the
    same stack before this one has a higher unit, or, with none before, the nearest after a lower one."""
    stack, t = runs[at][2]
    for step in (-1, 1):
        n = at + step
        while 0 <= n < len(runs):
            label = runs[n][2]
            if isinstance(label, tuple) and label[0] == stack and label[1] != t:
                return (label[1] > t) == (step == -1)
            n += step
    return False


def _renamed(record, donor, where, me, unit):
    """A copy of ``record`` for the deep model: the full block index in its module path, its donor."""
    module = record.module
    if where is not None and me[0] != "x" and module.startswith(where[0] + ".") and me[:1] == where[:1]:
        offset, tail = where[2]
        module = f"{where[0]}.{me[1] * unit + offset}" + (f".{tail}" if tail else "")
    return replace(record, module=module, donor=donor)
