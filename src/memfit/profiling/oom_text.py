"""Reading an out-of-memory error: torch's own messages, pasted or inside a log, as numbers.

Four messages are read, the last one in the text winning (a log holds the retries before the one that
killed the run):

* CUDA, torch >= 2.1 (``c10/cuda/CUDACachingAllocator.cpp``)::

    CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which
    1.06 GiB is free. Process 12345 has 30.00 GiB memory in use. Including non-PyTorch memory, this
    process has 78.12 GiB memory in use. Of the allocated memory 70.50 GiB is allocated by PyTorch, and
    6.90 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large ...

  (2.1 spells it "total capacty"; "40.00 GiB allowed;" follows the processes when
  ``set_per_process_memory_fraction`` caps the process; "Process N has ..." repeats per other process);
* CUDA, torch < 2.1: ``Tried to allocate 36.00 MiB (GPU 0; 7.93 GiB total capacity; 130.35 MiB already
  allocated; 47.06 MiB free; [2.00 GiB allowed; ]188.00 MiB reserved in total by PyTorch)``;
* the CPU allocator: ``DefaultCPUAllocator: not enough memory: you tried to allocate 123456 bytes.``
  (or ``can't allocate memory``);
* memfit's virtual budget (``accounting/budget.py``): ``memfit virtual budget: tried to allocate 1.00 MiB
  with 250.00 MiB of 256.00 MiB in use``, and its injected faults (no figures);
* Apple's MPS (``aten/src/ATen/mps/MPSAllocator.mm``, torch 2.11 at 57ba412, lines 286-295;
  ``research/mps/notes.md``)::

    MPS backend out of memory (MPS allocated: 5.50 GB, other allocations: 14.76 GB, max allowed: 20.40 GB).
    Tried to allocate 147.24 MB on private pool. Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable ...

  "MPS allocated" is what its heaps hold (cache included), "other allocations" the rest of what Metal holds for the
  process, "max allowed" the high watermark (1.7 x the GPU's recommended working set by default; absent when the
  ratio is 0.0). Its sizes are binary whatever the label (older torch printed "GB" for GiB).

Sizes are c10's ``format_size`` (two decimals of B/KiB/MiB/GiB), so a figure read back is within half
a hundredth of its unit. A log that wraps the message over lines is read as one line.

ROCm's "HIP out of memory" is the CUDA wording with another name and is read as it. Left out: XPU's.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

__all__ = ["OomMessage", "parse_oom", "c10_size", "KINDS"]

#: what ``OomMessage.kind`` says the message was
KINDS = ("cuda", "cuda-legacy", "cpu", "virtual", "mps")

_UNIT = {"b": 1, "byte": 1, "bytes": 1, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
         "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4}
_SIZE = r"(\d+(?:\.\d+)?)\s*(bytes|byte|B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)"
_STARTS = re.compile(r"(?:CUDA|HIP) out of memory|DefaultCPUAllocator: (?:not enough memory|can't allocate memory)"
                     r"|memfit virtual budget:|MPS backend out of memory")
_WINDOW = 2000  # characters after a message's start that may hold its figures (the new CUDA one is ~600)

_NEW = {
    "requested": re.compile(r"Tried to allocate " + _SIZE + r"\s*\."),
    "capacity": re.compile(r"GPU (\d+) has a total capac(?:i)?ty of " + _SIZE + " of which " + _SIZE + " is free"),
    "this_process": re.compile(r"this process has " + _SIZE + " memory in use"),
    "allowed": re.compile(_SIZE + r" allowed;"),
    "allocated": re.compile(r"Of the allocated memory " + _SIZE + " is allocated by PyTorch"),
    "reserved_unallocated": re.compile(_SIZE + r" is reserved by PyTorch but unallocated"),
}
_PROCESS = re.compile(r"Process (\d+) has " + _SIZE + " memory in use")
_LEGACY = re.compile(r"Tried to allocate " + _SIZE + r" \(GPU (\d+); " + _SIZE + r" total capacity; " + _SIZE
                     + r" already allocated; " + _SIZE + r" free; (?:" + _SIZE + r" allowed; )?" + _SIZE
                     + r" reserved in total by PyTorch")
_CPU = re.compile(r"you tried to allocate (\d+) bytes")
_MPS = re.compile(r"MPS allocated: " + _SIZE + r", other allocations: " + _SIZE + r"(?:, max allowed: " + _SIZE
                  + r")?\)\. Tried to allocate " + _SIZE + r" on (shared|private) pool")
_VIRTUAL = re.compile(r"tried to allocate " + _SIZE + " with " + _SIZE + " of " + _SIZE + " in use")


@dataclass(frozen=True)
class OomMessage:
    """The figures of one out-of-memory message, in bytes (None where the message does not say).

    kind                  "cuda", "cuda-legacy" (torch < 2.1), "cpu", "virtual" (memfit's budget) or "mps"
    device                "cuda:0", "cpu", "mps"
    requested             the allocation that failed
    capacity              the device's total memory ("total capacity"); the virtual budget's limit; MPS's high
                          watermark
    allowed               the process's cap (``set_per_process_memory_fraction``: on what PyTorch reserves,
                          the CUDA context not included), when set
    free                  what the device had free
    this_process          what this process held, CUDA context and non-PyTorch memory included
                          (the virtual budget: its live bytes)
    allocated             held by PyTorch's tensors
    reserved_unallocated  cached by PyTorch's allocator in segments it could not release (fragmented)
    other_processes       (pid, bytes) of each other process on the device
    message               the message as found, on one line
    """

    kind: str
    device: str
    message: str
    requested: int | None = None
    capacity: int | None = None
    allowed: int | None = None
    free: int | None = None
    this_process: int | None = None
    allocated: int | None = None
    reserved_unallocated: int | None = None
    other_processes: tuple[tuple[int, int], ...] = field(default_factory=tuple)
    mps_heaps: int | None = None  # MPS: what its allocator's heaps hold, cache included ("MPS allocated")
    mps_other: int | None = None  # MPS: the rest of what Metal holds for the process ("other allocations")

    @property
    def other_bytes(self) -> int:
        """What the other processes on the device held, together."""
        return sum(b for _, b in self.other_processes)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["other_processes"] = [{"pid": pid, "bytes": b} for pid, b in self.other_processes]
        data["other_bytes"] = self.other_bytes
        return data


def c10_size(nbytes: int) -> str:
    """``nbytes`` as torch's messages print it (c10's ``format_size``): the unit changes past each
    power of 1024, two decimals."""
    if nbytes <= 1024:
        return f"{nbytes} bytes"
    for unit, scale in (("KiB", 1024), ("MiB", 1024**2), ("GiB", 1024**3)):
        if nbytes <= scale * 1024 or unit == "GiB":
            return f"{nbytes / scale:.2f} {unit}"
    raise AssertionError("unreachable")


def parse_oom(text: str) -> OomMessage | None:
    """The last out-of-memory message in ``text`` (a traceback, a log), or None when it holds none."""
    starts = list(_STARTS.finditer(text))
    if not starts:
        return None
    start = starts[-1]
    window = " ".join(text[start.start():start.start() + _WINDOW].split())
    kind = start.group(0)
    if kind.startswith("MPS"):
        return _mps(window)
    if kind.endswith("out of memory"):
        return _legacy(window) or _cuda(window)
    if kind.startswith("DefaultCPU"):
        found = _CPU.search(window)
        return OomMessage("cpu", "cpu", _cut(window, "bytes.") if found else window[:200],
                          requested=int(found.group(1)) if found else None)
    return _virtual(window)


def _bytes(number: str, unit: str) -> int:
    return int(round(float(number) * _UNIT[unit.lower()]))


def _cut(window: str, end: str) -> str:
    """The message up to the first ``end`` (included), or its first 600 characters."""
    at = window.find(end)
    return window[:at + len(end)] if at >= 0 else window[:600]


def _cuda(window: str) -> OomMessage:
    figures, device = {}, "cuda"
    for name, pattern in _NEW.items():
        found = pattern.search(window)
        if found is None:
            continue
        groups = found.groups()
        if name == "capacity":
            device = f"cuda:{groups[0]}"
            figures["capacity"], figures["free"] = _bytes(*groups[1:3]), _bytes(*groups[3:5])
        else:
            figures[name] = _bytes(*groups[:2])
    others = tuple((int(m.group(1)), _bytes(m.group(2), m.group(3))) for m in _PROCESS.finditer(window))
    return OomMessage("cuda", device, _cut(window, "but unallocated."), other_processes=others, **figures)


def _legacy(window: str) -> OomMessage | None:
    found = _LEGACY.search(window)
    if found is None:
        return None
    g = found.groups()
    allocated, reserved = _bytes(g[5], g[6]), _bytes(g[11], g[12])
    return OomMessage("cuda-legacy", f"cuda:{g[2]}", _cut(window, "by PyTorch)"), requested=_bytes(g[0], g[1]),
                      capacity=_bytes(g[3], g[4]), free=_bytes(g[7], g[8]),
                      allowed=_bytes(g[9], g[10]) if g[9] else None, allocated=allocated,
                      reserved_unallocated=max(reserved - allocated, 0))


def _virtual(window: str) -> OomMessage:
    found = _VIRTUAL.search(window)
    if found is None:  # an injected fault: no figures
        return OomMessage("virtual", "cpu", _cut(window, ")"))
    g = found.groups()
    return OomMessage("virtual", "cpu", _cut(window, "in use"), requested=_bytes(g[0], g[1]),
                      this_process=_bytes(g[2], g[3]), capacity=_bytes(g[4], g[5]))


def _mps(window: str) -> OomMessage:
    found = _MPS.search(window)
    if found is None:
        return OomMessage("mps", "mps", _cut(window, "pool."))
    g = found.groups()

    def size(number, unit):  # MPS prints binary sizes, older torch with decimal-looking labels ("GB" for GiB)
        return int(round(float(number) * 1024 ** "bkmgt".index(unit[0].lower())))

    heaps, other = size(g[0], g[1]), size(g[2], g[3])
    limit = size(g[4], g[5]) if g[4] else None
    return OomMessage("mps", "mps", _cut(window, "pool."), requested=size(g[6], g[7]), capacity=limit, allowed=limit,
                      this_process=heaps + other, free=None if limit is None else max(limit - heaps - other, 0),
                      mps_heaps=heaps, mps_other=other)
