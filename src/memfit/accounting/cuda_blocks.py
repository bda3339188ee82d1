"""The CUDA caching allocator's vocabulary: sizes, blocks, pools, and what it reports.

``cuda_allocator.py`` holds the allocator's request logic (``malloc`` / ``free``: best fit,
splitting, merging), ``cuda_segments.py`` how segments are released and how expandable segments map
and unmap pages. Here: torch's constants (``c10/cuda/CUDACachingAllocator.cpp``,
``c10/core/AllocatorConfig.h``), the rounding of a request to a block size (``round_size``,
``roundup_power2_divisions``) and of a new segment (``get_allocation_size``), the block, segment and
pool structures both share, and the statistics and OOM error the allocator hands out.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

__all__ = [
    "AllocatorStats",
    "SegmentInfo",
    "SimulatedOutOfMemory",
    "get_allocation_size",
    "round_size",
]

MiB = 1 << 20
kMinBlockSize = 512  # every size is rounded to at least this
kSmallSize = MiB  # largest "small" request
kSmallBuffer = 2 * MiB  # small requests are packed in segments of this size
kLargeBuffer = 20 * MiB  # large requests under kMinLargeAlloc are packed in segments of this size
kMinLargeAlloc = 10 * MiB
kRoundLarge = 2 * MiB  # larger segments are rounded up to this
kMaxNonSplitRoundingSize = kLargeBuffer  # AcceleratorAllocatorConfig default (max_non_split_rounding_mb)
kRoundUpPowerOfTwoIntervals = 16  # 1 MiB .. 64 GiB, one division count per power of two
_UNLIMITED = float("inf")
_VA_SIZE = 1 << 44  # virtual range of one expandable segment: larger than any device
_SEGMENT_ALIGN = 2 * MiB


class SimulatedOutOfMemory(MemoryError):
    """``malloc`` could not be served even after releasing every cached segment (torch's OOM)."""

    def __init__(self, size: int, alloc_size: int, stats: AllocatorStats):
        self.size, self.alloc_size, self.stats = size, alloc_size, stats
        super().__init__(
            f"simulated CUDA out of memory: tried to allocate {alloc_size} bytes for a {size}-byte request; "
            f"{stats.allocated} allocated, {stats.reserved} reserved"
        )


@dataclass(frozen=True)
class AllocatorStats:
    """A copy of the counters, named as in ``torch.cuda.memory_stats`` where there is one.

    ``fragmentation_at_peak`` is ``peak_reserved`` minus the most that was allocated while reserved
    stood at its peak: cached bytes no allocation used at the worst moment. ``largest_free_at_peak``
    is the biggest free (mapped) block at that same moment. ``segments`` counts ``cudaMalloc``
    segments, plus one per expandable segment that has memory mapped.
    """

    allocated: int
    reserved: int
    requested: int
    peak_allocated: int
    peak_reserved: int
    peak_requested: int
    segments: int
    peak_segments: int
    fragmentation_at_peak: int
    largest_free_at_peak: int
    num_device_alloc: int  # cudaMalloc calls + cuMemMap calls (torch's num_device_alloc)
    num_device_free: int
    num_alloc_retries: int
    num_ooms: int


@dataclass(frozen=True)
class SegmentInfo:
    """One segment as ``torch.cuda.memory_snapshot`` would list it: its blocks in address order.

    For an expandable segment, one entry per contiguous mapped range.
    """

    address: int
    size: int
    is_small: bool
    stream: int
    blocks: tuple[tuple[int, bool], ...]  # (size, allocated)


def _power2_divisions(size: int, divisions: tuple[int, ...] | None) -> int:
    """``AcceleratorAllocatorConfig::roundup_power2_divisions(size)``."""
    if divisions is None:
        return 0
    log_size = size.bit_length() - 1
    index = max(log_size - 20, 0)  # intervals start at 1 MiB
    return divisions[min(index, kRoundUpPowerOfTwoIntervals - 1)]


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    if size & (size - 1) == 0:
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    step = power2_floor >> (divisions.bit_length() - 1)
    if step == 0:
        return power2_floor << 1
    floor = size & ~(step - 1)
    return size if floor == size else floor + step


def _parse_divisions(value) -> tuple[int, ...] | None:
    """``roundup_power2_divisions`` as torch's config takes it: one count for every size, or a
    mapping ``{MiB power of two: count, ">": count}`` like ``[256:1,512:2,>:4]``."""
    if value is None:
        return None
    if isinstance(value, int):
        _check_power2(value)
        return (value,) * kRoundUpPowerOfTwoIntervals
    table = [0] * kRoundUpPowerOfTwoIntervals
    first, last_index = True, 0
    for key, count in value.items():
        if count:  # 0 turns rounding off for that interval
            _check_power2(count)
        if key == ">":
            for i in range(last_index + 1, kRoundUpPowerOfTwoIntervals):
                table[i] = count
            continue
        _check_power2(int(key))
        index = min(int(key).bit_length() - 1, kRoundUpPowerOfTwoIntervals - 1)
        if first:
            for i in range(index):
                table[i] = count
            first = False
        table[index] = count
        last_index = index
    return tuple(table)


def _check_power2(n: int) -> None:
    if n <= 0 or n & (n - 1):
        raise ValueError(f"roundup_power2_divisions values must be powers of 2, got {n}")


def round_size(size: int, *, roundup_power2_divisions=None) -> int:
    """The block size the allocator carves for a request of ``size`` bytes.

    >>> round_size(1), round_size(513), round_size(4096)
    (512, 1024, 4096)
    """
    return _round_size(size, _parse_divisions(roundup_power2_divisions))


def _round_size(size: int, divisions: tuple[int, ...] | None) -> int:
    if size < kMinBlockSize:
        return kMinBlockSize
    n = _power2_divisions(size, divisions)
    if n > 1 and size > kMinBlockSize * n:
        return _roundup_power2_next_division(size, n)
    return kMinBlockSize * ((size + kMinBlockSize - 1) // kMinBlockSize)


def get_allocation_size(size: int) -> int:
    """Size of the segment ``cudaMalloc``-ed for a (rounded) request that no cached block serves."""
    if size <= kSmallSize:
        return kSmallBuffer
    if size < kMinLargeAlloc:
        return kLargeBuffer
    return kRoundLarge * ((size + kRoundLarge - 1) // kRoundLarge)


class _Segment:
    """Expandable segment: a virtual range whose pages are mapped one by one."""

    __slots__ = ("base", "mapped_pages", "page")

    def __init__(self, base: int, page: int):
        self.base, self.page, self.mapped_pages = base, page, 0


class _Block:
    __slots__ = ("allocated", "gc_base", "mapped", "next", "pool", "prev", "ptr", "requested", "segment", "size",
                 "stream")

    def __init__(self, ptr, size, stream, pool, segment=None, mapped=True):
        self.ptr, self.size, self.stream, self.pool = ptr, size, stream, pool
        self.requested = 0
        self.allocated = False
        self.mapped = mapped
        self.prev = self.next = None
        self.segment = segment  # _Segment for expandable segments, else None
        self.gc_base = 0  # the pool's get_free_block count when this block entered the free set

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def splice(self, before, after) -> None:
        if before is not None:
            before.next = self
        self.prev = before
        if after is not None:
            after.prev = self
        self.next = after


class _SortedBlocks:
    """``std::set<Block*>`` with a key function: a sorted list of keys plus a map to the blocks."""

    __slots__ = ("blocks", "by_size", "calls", "keys")

    def __init__(self, by_size: bool):
        self.keys: list[tuple] = []
        self.blocks: dict[tuple, _Block] = {}
        self.by_size = by_size
        self.calls = 0  # torch's get_free_blocks_call_count (counted only while garbage collection is on)

    def key(self, b: _Block) -> tuple:
        return (b.stream, b.size, b.ptr) if self.by_size else (b.stream, b.ptr)

    def insert(self, b: _Block) -> None:
        """``insert_into_blocks``: entering the free set restarts the block's age."""
        b.gc_base = self.calls
        k = self.key(b)
        bisect.insort(self.keys, k)
        self.blocks[k] = b

    def erase(self, b: _Block) -> None:
        k = self.key(b)
        del self.blocks[k]
        del self.keys[bisect.bisect_left(self.keys, k)]

    def __contains__(self, b: _Block) -> bool:
        return self.blocks.get(self.key(b)) is b

    def lower_bound(self, key: tuple) -> int:
        return bisect.bisect_left(self.keys, key)

    def at(self, index: int) -> _Block:
        return self.blocks[self.keys[index]]

    def __len__(self) -> int:
        return len(self.keys)


class _Pool:
    __slots__ = ("blocks", "is_small", "unmapped")

    def __init__(self, is_small: bool):
        self.is_small = is_small
        self.blocks = _SortedBlocks(by_size=True)  # free, mapped blocks
        self.unmapped = _SortedBlocks(by_size=False)  # expandable segments' unmapped ranges
