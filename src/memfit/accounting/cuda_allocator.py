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

Where the code is: this module holds the request logic; ``cuda_blocks.py`` the sizes, blocks, pools
and statistics; ``cuda_segments.py`` the release paths and expandable segments.

Not modelled (streams are, as each request carries one: FSDP2 allocates on three; these need a real device or clock):
``record_stream`` and the CUDA events that delay a free, CUDA-graph private pools and mempools,
free-memory callbacks, IPC, other processes on the device, and the driver's choice of virtual
addresses (segments are laid out at increasing addresses, which only matters as a tie-break between
equal-sized free blocks).
"""

from __future__ import annotations

import itertools

from memfit.accounting.cuda_blocks import (
    _SEGMENT_ALIGN,
    _UNLIMITED,
    AllocatorStats,
    SegmentInfo,
    SimulatedOutOfMemory,
    _Block,
    _parse_divisions,
    _Pool,
    _round_size,
    _Segment,
    get_allocation_size,
    kLargeBuffer,
    kMaxNonSplitRoundingSize,
    kMinBlockSize,
    kSmallSize,
    round_size,
)
from memfit.accounting.cuda_segments import _Segments

# The allocator's whole public API, with the types it hands out (defined in cuda_blocks.py).
__all__ = [
    "AllocatorStats",
    "CachingAllocator",
    "SegmentInfo",
    "SimulatedOutOfMemory",
    "get_allocation_size",
    "round_size",
    "simulate",
]


class CachingAllocator(_Segments):
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
