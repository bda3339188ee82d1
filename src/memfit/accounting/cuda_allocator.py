"""A pure-Python model of PyTorch's CUDA caching allocator, to turn a sequence of allocations and
frees into what ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` would report.

Written by hand because nothing else does this without a GPU: torch only exposes the real
allocator (``c10/cuda/CUDACachingAllocator.cpp``), which needs a CUDA device, and its snapshot and
trace tools only *record* what a real run did. The rules follow that file as it stands from torch
2.10 on (the same rules appear in the newer generic ``c10/core/CachingDeviceAllocator.h``), with
constants and config defaults from ``c10/core/AllocatorConfig.h`` of torch 2.13. Replaying the
torch 2.11 H100 allocator traces (``bench/results/cuda-traces-h100.json.gz``, with the model and
batch allocated before recording added back) gives the measured allocated, reserved and requested
peaks to the byte for the 32 small training runs; the large ones differ where the trace cannot say
which of several same-sized tensors a free releases. Function by function, with torch's names:

* ``round_size``: requests below 512 B become 512 B, others go up to a multiple of 512 B
  (``kMinBlockSize``), or, with ``roundup_power2_divisions``, to the next of N equal steps between
  two powers of two (``roundup_power2_next_division``).
* Two pools: rounded sizes up to 1 MiB (``kSmallSize``) are "small", the rest "large". Free blocks
  are kept in a set ordered by (stream, size, address); a stream only reuses its own blocks.
* ``get_allocation_size``: a new small segment is 2 MiB (``kSmallBuffer``); a large request under
  10 MiB (``kMinLargeAlloc``) gets a 20 MiB segment (``kLargeBuffer``); bigger ones are rounded up to
  2 MiB (``kRoundLarge``).
* ``get_free_block``: best fit, the smallest cached block of the stream that is big enough, with the
  ``max_split_size`` rules (a request under it never takes a block at or over it; a request at or
  over it only takes a block less than ``max_non_split_rounding_size`` (20 MiB) larger).
* ``should_split``: the unused tail of a block becomes a free block of its own if it is at least
  512 B (small pool, and every pool with expandable segments) or more than 1 MiB (large pool);
  otherwise the whole block is handed out and counted as allocated.
* ``free_block``: a freed block merges with free neighbours of its segment and goes back to the pool.
  Segments stay cached; memory goes back to the device only when a new segment does not fit:
  ``alloc_block`` fails when ``reserved + alloc_size`` passes ``allowed_memory`` (torch's
  ``allowed_memory_maximum``, set by ``set_per_process_memory_fraction``; checked with the whole
  ``alloc_size`` even with expandable segments) or when the segment (or the pages to map) does not
  fit the device's ``capacity`` (``cudaMalloc`` / ``cuMemCreate`` failing). Then
  ``release_available_cached_blocks`` (oversize blocks, only when ``max_split_size`` is set), then
  ``release_cached_blocks`` (every wholly free segment, large pool then small, and every free page
  of an expandable segment: torch synchronises the device here, so each round is slow), then one
  retry (``num_alloc_retries``); after that, :class:`SimulatedOutOfMemory`.
* ``garbage_collect_cached_blocks``: only with ``allowed_memory`` set and
  ``garbage_collection_threshold`` > 0, when no cached block serves a request and before
  ``alloc_block``: if ``reserved`` is over threshold x ``allowed_memory``, wholly free (unsplit)
  large-pool segments whose age is at least the mean age are ``cudaFree``-d, pass after pass, until
  the excess is reclaimed or none is left. A block's age (``gc_count``) is the number of
  ``get_free_block`` calls on its pool since it last entered the free set; calls are counted only
  while garbage collection is on.
* ``expandable_segments``: one segment per (pool, stream) with a virtual range far larger than the
  device, mapped in pages of 2 MiB (small pool) or 20 MiB (large pool, ``kLargeBuffer``) as needed:
  ``find_expandable_block`` / ``try_allocate_expandable_block`` / ``map_block`` grow the lowest
  address range that fits, merging with the free block just before it; release unmaps whole free
  pages only (``unmap_block``).
* Statistics as ``torch.cuda.memory_stats`` keeps them: ``allocated_bytes`` counts block sizes
  (rounded, plus any unsplit tail), ``requested_bytes`` the sizes asked for, ``reserved_bytes``
  segment (or mapped) bytes; each with its peak.

Not modelled (one stream is what a training step uses, and these need a real device or clock):
``record_stream`` and the CUDA events that delay a free, CUDA-graph private pools and mempools,
free-memory callbacks, IPC, other processes on the device, and the driver's choice of virtual
addresses (segments are laid out at increasing addresses, which only matters as a tie-break between
equal-sized free blocks).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

__all__ = [
    "AllocatorStats",
    "CachingAllocator",
    "SegmentInfo",
    "SimulatedOutOfMemory",
    "get_allocation_size",
    "round_size",
    "simulate",
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


class CachingAllocator:
    """The allocator of one CUDA device, driven by ``malloc`` / ``free`` calls.

    Knobs mirror ``PYTORCH_CUDA_ALLOC_CONF`` (all off by default, like torch):

    * ``expandable_segments``: ``expandable_segments:True``.
    * ``capacity``: bytes of device memory the allocator may hold (``None``: unlimited), the card's
      memory less the CUDA context. A new segment or page that would take ``reserved`` over it fails
      like ``cudaMalloc`` does, which triggers the release-and-retry path and, failing that,
      :class:`SimulatedOutOfMemory`.
    * ``allowed_memory``: ``torch.cuda.set_per_process_memory_fraction(f)``'s limit in bytes (f x the
      device's total memory); ``alloc_block`` refuses when ``reserved + alloc_size`` would pass it.
    * ``garbage_collection_threshold``: ``garbage_collection_threshold:T``, 0 < T < 1; torch ignores it
      unless a memory fraction is set, and so does this model (``allowed_memory=None``).
    * ``max_split_size``: ``max_split_size_mb`` in bytes; at least 20 MiB, as torch requires.
    * ``roundup_power2_divisions``: an int, or a ``{MiB: divisions, ">": divisions}`` mapping.
    """

    def __init__(self, *, expandable_segments: bool = False, capacity: int | None = None,
                 max_split_size: int | None = None, roundup_power2_divisions=None,
                 allowed_memory: int | None = None, garbage_collection_threshold: float = 0.0):
        if max_split_size is not None and max_split_size < kLargeBuffer:
            raise ValueError("max_split_size must be at least 20 MiB (torch: max_split_size_mb >= 20)")
        if not 0.0 <= garbage_collection_threshold < 1.0:
            raise ValueError("garbage_collection_threshold must be in (0, 1), as torch requires")
        self.expandable = bool(expandable_segments)
        self.capacity = capacity
        self.allowed_memory = allowed_memory
        self._gc_threshold = garbage_collection_threshold if allowed_memory is not None else 0.0
        self.max_split_size = _UNLIMITED if max_split_size is None else int(max_split_size)
        self._divisions = _parse_divisions(roundup_power2_divisions)
        self._small, self._large = _Pool(True), _Pool(False)
        self._handles: dict[int, _Block | None] = {}
        self._ids = itertools.count(1)
        self._next_address = _SEGMENT_ALIGN
        self._streams: set[int] = set()
        self._heads: set[_Block] = set()  # first block of each cudaMalloc segment
        self._expandable: list[_Segment] = []
        self.allocated = self.reserved = self.requested = 0
        self.num_device_alloc = self.num_device_free = self.num_alloc_retries = self.num_ooms = 0
        self.reset_peak_stats()

    # ----------------------------------------------------------------------------- public API

    def malloc(self, size: int, *, stream: int = 0) -> int:
        """Allocate ``size`` bytes on ``stream``; returns a handle for :meth:`free`."""
        if size < 0:
            raise ValueError("size must be >= 0")
        handle = next(self._ids)
        if size == 0:  # torch hands out a null pointer without touching the allocator
            self._handles[handle] = None
            return handle
        self._streams.add(stream)
        rounded = _round_size(size, self._divisions)
        pool = self._small if rounded <= kSmallSize else self._large
        alloc_size = get_allocation_size(rounded)
        block = self._get_free_block(pool, stream, rounded)
        if block is None:
            if self._gc_threshold > 0:
                self._garbage_collect_cached_blocks()
            block = (
                self._alloc_block(pool, stream, rounded, alloc_size)
                or (self._release_available_cached_blocks(pool, stream, rounded)
                    and self._alloc_block(pool, stream, rounded, alloc_size))
                or (self._release_cached_blocks()
                    and self._alloc_block(pool, stream, rounded, alloc_size, retry=True))
            )
        if not block:
            self.num_ooms += 1
            raise SimulatedOutOfMemory(size, alloc_size, self.stats)
        block = self._alloc_found_block(block, rounded, size, self._should_split(block, rounded))
        self._handles[handle] = block
        self._after_malloc()
        return handle

    def free(self, handle: int) -> None:
        """Free what ``malloc`` returned as ``handle``."""
        block = self._handles.pop(handle)
        if block is None:
            return
        block.allocated = False
        self.allocated -= block.size
        self._free_block(block)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: give every wholly free segment (or free page) back."""
        self._release_cached_blocks()

    def reset_peak_stats(self) -> None:
        """``torch.cuda.reset_peak_memory_stats()``: peaks restart from the current values."""
        self.peak_allocated, self.peak_reserved, self.peak_requested = self.allocated, self.reserved, self.requested
        self.peak_segments = self.segments
        self._at_peak_allocated = self.allocated
        self._at_peak_largest_free = self._largest_free()

    @property
    def segments(self) -> int:
        return len(self._heads) + sum(1 for s in self._expandable if s.mapped_pages)

    @property
    def stats(self) -> AllocatorStats:
        return AllocatorStats(
            allocated=self.allocated, reserved=self.reserved, requested=self.requested,
            peak_allocated=self.peak_allocated, peak_reserved=self.peak_reserved,
            peak_requested=self.peak_requested, segments=self.segments, peak_segments=self.peak_segments,
            fragmentation_at_peak=self.peak_reserved - self._at_peak_allocated,
            largest_free_at_peak=self._at_peak_largest_free,
            num_device_alloc=self.num_device_alloc, num_device_free=self.num_device_free,
            num_alloc_retries=self.num_alloc_retries, num_ooms=self.num_ooms,
        )

    def snapshot(self) -> list[SegmentInfo]:
        """Every segment (mapped range, for expandable ones) with its blocks, by address."""
        heads = []
        for pool in (self._small, self._large):
            for b in list(pool.blocks.blocks.values()) + [h for h in self._live_blocks() if h.pool is pool]:
                if b.prev is None or not b.prev.mapped:
                    heads.append(b)
        out = []
        for head in sorted(set(heads), key=lambda b: b.ptr):
            blocks, b = [], head
            while b is not None and b.mapped:
                blocks.append((b.size, b.allocated))
                b = b.next
            out.append(SegmentInfo(head.ptr, sum(s for s, _ in blocks), head.pool.is_small, head.stream,
                                   tuple(blocks)))
        return out

    # ----------------------------------------------------------------------------- internals

    def _live_blocks(self):
        return [b for b in self._handles.values() if b is not None]

    def _largest_free(self) -> int:
        best = 0
        for pool in (self._small, self._large):
            keys = pool.blocks.keys
            if not keys:
                continue
            if len(self._streams) <= 1:
                best = max(best, keys[-1][1])
            else:
                best = max(best, max(k[1] for k in keys))
        return best

    def _after_malloc(self) -> None:
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_requested = max(self.peak_requested, self.requested)
        if self.reserved == self.peak_reserved and self.allocated > self._at_peak_allocated:
            self._at_peak_allocated = self.allocated
            self._at_peak_largest_free = self._largest_free()

    def _grew_reserved(self) -> None:
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
            self._at_peak_allocated = self.allocated
            self._at_peak_largest_free = self._largest_free()
        self.peak_segments = max(self.peak_segments, self.segments)

    def _fits(self, nbytes: int) -> bool:
        return self.capacity is None or self.reserved + nbytes <= self.capacity

    def _new_address_range(self, size: int) -> int:
        base = self._next_address
        self._next_address += -(-size // _SEGMENT_ALIGN) * _SEGMENT_ALIGN + _SEGMENT_ALIGN
        return base

    # get_free_block
    def _get_free_block(self, pool: _Pool, stream: int, size: int) -> _Block | None:
        blocks = pool.blocks
        if self._gc_threshold > 0:  # block reuse is tracked only while garbage collection is on
            blocks.calls += 1
        i = blocks.lower_bound((stream, size, 0))
        if i == len(blocks) or blocks.keys[i][0] != stream:
            return None
        block = blocks.at(i)
        if block.segment is not None:
            # Best fit counts a block at the end of an expandable segment as the size it can grow to.
            def expandable_size(b):
                return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

            j = i + 1
            while (block.segment is not None and j < len(blocks) and blocks.keys[j][0] == stream
                   and expandable_size(blocks.at(j)) < expandable_size(block)):
                block = blocks.at(j)
                j += 1
        mss = self.max_split_size
        if size < mss and block.size >= mss:  # no oversize block for a small request
            return None
        if size >= mss and block.size >= size + kMaxNonSplitRoundingSize:
            return None
        blocks.erase(block)
        return block

    # should_split
    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.pool.is_small or self.expandable:
            return remaining >= kMinBlockSize
        return size < self.max_split_size and remaining > kSmallSize

    # alloc_block
    def _alloc_block(self, pool: _Pool, stream: int, size: int, alloc_size: int, retry: bool = False):
        if retry:
            self.num_alloc_retries += 1
        if self.allowed_memory is not None and self.reserved + alloc_size > self.allowed_memory:
            return None  # the memory fraction: checked with alloc_size, expandable segments too
        if self.expandable:
            return self._try_allocate_expandable_block(pool, stream, size)
        if not self._fits(alloc_size):
            return None
        block = _Block(self._new_address_range(alloc_size), alloc_size, stream, pool)
        self._heads.add(block)
        self.reserved += alloc_size
        self.num_device_alloc += 1
        self._grew_reserved()
        return block

    # alloc_found_block
    def _alloc_found_block(self, block: _Block, size: int, orig_size: int, split: bool) -> _Block:
        pool = block.pool
        if split:
            remaining = block
            block = _Block(remaining.ptr, size, remaining.stream, pool, remaining.segment)
            block.prev, block.next = remaining.prev, remaining
            if block.prev is not None:
                block.prev.next = block
            else:
                self._replace_head(remaining, block)
            remaining.prev = block
            remaining.ptr += size
            remaining.size -= size
            pool.blocks.insert(remaining)
        block.allocated = True
        block.requested = orig_size
        self.allocated += block.size
        self.requested += orig_size
        return block

    def _replace_head(self, old: _Block, new: _Block) -> None:
        if old in self._heads:
            self._heads.discard(old)
            self._heads.add(new)

    # free_block
    def _free_block(self, block: _Block) -> None:
        self.requested -= block.requested
        block.requested = 0
        for candidate in (block.prev, block.next):
            self._try_merge_blocks(block, candidate, block.pool)
        block.pool.blocks.insert(block)

    # try_merge_blocks
    def _try_merge_blocks(self, dst: _Block, src: _Block | None, pool: _Pool) -> int:
        if src is None or src.allocated or dst.mapped != src.mapped:
            return 0
        (pool.blocks if src.mapped else pool.unmapped).erase(src)
        if dst.prev is src:  # [src dst]
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
            else:
                self._replace_head(src, dst)
        else:  # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    # garbage_collect_cached_blocks
    def _garbage_collect_cached_blocks(self) -> None:
        threshold = int(self._gc_threshold * self.allowed_memory)
        if self.reserved <= threshold:
            return
        target, reclaimed = self.reserved - threshold, 0
        blocks = self._large.blocks

        def freeable():
            return [b for b in (blocks.blocks[k] for k in blocks.keys) if not b.is_split() and b.segment is None]

        ages = {b: blocks.calls - b.gc_base for b in freeable()}
        total_age, count = sum(ages.values()), len(ages)
        freed = True
        while reclaimed < target and freed and count > 0:
            mean_age = total_age / count
            freed = False
            for b in freeable():  # free every block at least as old as the mean, past the target too
                if ages[b] >= mean_age:
                    freed = True
                    reclaimed += b.size
                    total_age -= ages[b]
                    count -= 1
                    self._release_block(b)

    # release_available_cached_blocks
    def _release_available_cached_blocks(self, pool: _Pool, stream: int, size: int) -> bool:
        mss = self.max_split_size
        if mss == _UNLIMITED:
            return False
        key_size = max(size, mss)
        blocks = pool.blocks
        i = blocks.lower_bound((stream, key_size, 0))
        if i == len(blocks) or blocks.keys[i][0] != stream or blocks.at(i).segment is not None:
            # no single block is large enough: free oversize blocks, largest first
            if i == 0:
                return False
            released = 0
            i -= 1
            while released < key_size and i >= 0:
                b = blocks.at(i)
                if b.size < mss or b.stream != stream:
                    break
                i -= 1
                if b.segment is None and not b.is_split():
                    released += b.size
                    self._release_block(b)
            return released >= key_size
        b = blocks.at(i)
        if b.is_split():  # torch only gets here with whole segments; keep the model safe
            return False
        self._release_block(b)
        return True

    # release_cached_blocks / release_blocks
    def _release_cached_blocks(self) -> bool:
        for pool in (self._large, self._small):
            to_unmap = []
            for b in [pool.blocks.blocks[k] for k in pool.blocks.keys]:
                if b.segment is not None:
                    to_unmap.append(b)
                elif not b.is_split():
                    self._release_block(b)
            for b in to_unmap:
                self._unmap_block(b)
                if b.prev is None and b.next is None and not b.mapped:
                    pool.unmapped.erase(b)
                    self._expandable.remove(b.segment)
        return True

    # release_block
    def _release_block(self, block: _Block) -> None:
        block.pool.blocks.erase(block)
        self._heads.discard(block)
        self.reserved -= block.size
        self.num_device_free += 1

    # ------------------------------------------------------------------ expandable segments

    def _page(self, pool: _Pool) -> int:
        return kSmallBuffer if pool.is_small else kLargeBuffer

    # find_expandable_block
    def _find_expandable_block(self, pool: _Pool, stream: int, size: int) -> _Block:
        def allocatable(b):
            return b is not None and not b.allocated

        def has_room(b):
            total = 0
            while total < size and allocatable(b):
                total += b.size
                b = b.next
            return total >= size

        unmapped = pool.unmapped
        i = unmapped.lower_bound((stream, -1))
        while i < len(unmapped) and unmapped.keys[i][0] == stream:
            c = unmapped.at(i)
            if allocatable(c.prev):
                c = c.prev
            if has_room(c):
                return c
            i += 1
        page = self._page(pool)
        segment = _Segment(self._new_address_range(_VA_SIZE), page)
        self._expandable.append(segment)
        candidate = _Block(segment.base, _VA_SIZE, stream, pool, segment, mapped=False)
        unmapped.insert(candidate)
        return candidate

    # try_allocate_expandable_block
    def _try_allocate_expandable_block(self, pool: _Pool, stream: int, size: int):
        candidate = self._find_expandable_block(pool, stream, size)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            nxt = candidate.next
            if nxt is None:  # larger than the segment's whole address range: cudaMalloc would fail too
                return None
            if not self._map_block(nxt, min(size - candidate.size, nxt.size)):
                return None
            candidate = nxt
        pool.blocks.erase(candidate)
        return candidate

    # map_block
    def _map_block(self, to_map: _Block, size: int) -> bool:
        segment, pool = to_map.segment, to_map.pool
        page = segment.page
        pages = -(-size // page)
        mapped = pages * page
        if not self._fits(mapped):
            return False
        pool.unmapped.erase(to_map)
        to_map.mapped = True
        if mapped < to_map.size:
            rest = _Block(to_map.ptr + mapped, to_map.size - mapped, to_map.stream, pool, segment, mapped=False)
            rest.splice(to_map, to_map.next)
            pool.unmapped.insert(rest)
            to_map.size = mapped
        self._try_merge_blocks(to_map, to_map.prev, pool)
        self._try_merge_blocks(to_map, to_map.next, pool)
        pool.blocks.insert(to_map)
        segment.mapped_pages += pages
        self.reserved += mapped
        self.num_device_alloc += 1
        self._grew_reserved()
        return True

    # unmap_block
    def _unmap_block(self, block: _Block) -> None:
        segment, pool = block.segment, block.pool
        page, base = segment.page, segment.base
        first = -(-(block.ptr - base) // page)
        last = (block.ptr + block.size - base) // page
        if first >= last:
            return
        pool.blocks.erase(block)
        start, length = base + first * page, (last - first) * page
        before = start - block.ptr
        if before > 0:
            b = _Block(block.ptr, before, block.stream, pool, segment)
            b.splice(block.prev, block)
            pool.blocks.insert(b)
        after = block.size - before - length
        if after > 0:
            a = _Block(start + length, after, block.stream, pool, segment)
            a.splice(block, block.next)
            pool.blocks.insert(a)
        block.ptr, block.size, block.mapped = start, length, False
        self._try_merge_blocks(block, block.prev, pool)
        self._try_merge_blocks(block, block.next, pool)
        pool.unmapped.insert(block)
        segment.mapped_pages -= last - first
        self.reserved -= length
        self.num_device_free += 1


def simulate(events, **knobs) -> AllocatorStats:
    """Run ``("alloc", key, size)`` / ``("free", key)`` events (an optional 4th alloc item is the
    stream) through a fresh :class:`CachingAllocator` built with ``knobs``; returns its stats.

    Raises :class:`SimulatedOutOfMemory` (carrying the stats at that point) if ``capacity`` is hit.
    """
    allocator = CachingAllocator(**knobs)
    live: dict = {}
    for event in events:
        if event[0] == "alloc":
            stream = event[3] if len(event) > 3 else 0
            live[event[1]] = allocator.malloc(event[2], stream=stream)
        elif event[0] == "free":
            allocator.free(live.pop(event[1]))
        else:
            raise ValueError(f"unknown event {event[0]!r}")
    return allocator.stats
