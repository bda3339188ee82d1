"""PyTorch's MPS allocator replayed: which Metal heaps a step's allocations open on a Mac, and what they hold.

``accounting/cuda_allocator.py`` replays CUDA's caching allocator; this is its counterpart for Apple silicon, from
``aten/src/ATen/mps/MPSAllocator.{h,mm}`` as ``hardware/mps.py`` cites them (torch 2.11 and 2.13): no library
replays MPS's allocator, and none runs without a Mac, so it is written here.

* A request is aligned (``heapBufferSizeAndAlignWithLength``: Metal's answer, assumed here to be the 16 KiB page of
  Apple silicon) and served from its pool: small up to 1 MiB, large above. A freed buffer goes back to its pool's
  cache whole, never split or merged; the smallest cached buffer at least the request's size is reused when it is at
  most 32 MiB (``kLargeHeap``) larger, and then counts at its full size.
* Otherwise a new buffer is placed in the pool's heap with the least room that holds it, or a new heap is opened:
  8 MiB for a small buffer, 32 MiB under 10 MiB, 1 GiB under 512 MiB, else the buffer's own size rounded to 2 MiB
  (``hardware.mps.heap_size``). A cached buffer keeps its heap's room; a heap goes back to Metal only when none of
  its buffers is live or cached.
* The limits act on what Metal holds (the heaps): from the low watermark on (memory pressure), a large request first
  frees the large pool's cached buffers and opens heaps of its own size only; a heap that would pass the high
  watermark makes the allocator free every cache and retry, and then fail ("MPS backend out of memory").

``held`` is ``m_total_allocated_memory`` (the heaps: what the process takes from the Mac's RAM, and what
``torch.accelerator.max_memory_reserved`` reports from 2.13); ``allocated`` is ``current_allocated_memory()``.
Left out: MPSGraph's own allocations (``hardware/outside.py``), the scalar pool (8-byte buffers), the garbage
collector's ageing (all idle cached buffers count as old), the bucketed rounding after 2.13, and Metal's placement
inside a heap (a heap's room is one number: no fragmentation within it).
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.hardware.mps import LARGE_HEAP, MAX_SMALL_ALLOC, heap_size

__all__ = ["MpsStats", "MpsOutOfMemory", "replay_mps", "PAGE"]

PAGE = 16 * 1024  # Apple silicon's VM page: the alignment assumed for every buffer


@dataclass
class MpsStats:
    peak_allocated: int = 0  # most bytes of live buffers (aligned, a reused buffer at its size)
    peak_held: int = 0  # most bytes of heaps at once
    heaps_opened: int = 0
    cache_releases: int = 0  # times the allocator freed its caches to stay under a limit


class MpsOutOfMemory(Exception):
    def __init__(self, stats: MpsStats, request: int, held: int):
        super().__init__(f"MPS backend out of memory: tried to allocate {request} bytes with {held} held")
        self.stats, self.request, self.held = stats, request, held


class _Heap:
    __slots__ = ("size", "room", "buffers")

    def __init__(self, size: int):
        self.size, self.room, self.buffers = size, size, 0


class _Allocator:
    def __init__(self, high: int | None, low: int | None):
        self.high, self.low = high, low
        self.stats = MpsStats()
        self.held = self.allocated = 0
        self.heaps = {True: [], False: []}  # small pool, large pool
        self.cached = {True: [], False: []}  # (size, heap) of buffers freed to each pool

    def _note(self) -> None:
        self.stats.peak_allocated = max(self.stats.peak_allocated, self.allocated)
        self.stats.peak_held = max(self.stats.peak_held, self.held)

    def _release(self, small: bool, index: int) -> None:
        """A cached buffer back to its heap; an empty heap back to Metal."""
        size, heap = self.cached[small].pop(index)
        heap.room += size
        heap.buffers -= 1
        if heap.buffers == 0:
            self.heaps[small].remove(heap)
            self.held -= heap.size

    def _release_all(self, small_too: bool = True) -> None:
        for small in ((True, False) if small_too else (False,)):
            while self.cached[small]:
                self._release(small, len(self.cached[small]) - 1)

    def malloc(self, nbytes: int) -> tuple[int, _Heap, bool]:
        size = -(-max(nbytes, 1) // PAGE) * PAGE
        small = size <= MAX_SMALL_ALLOC
        pressure = not small and self.low is not None and self.held >= self.low
        if pressure and self.cached[False]:
            self.stats.cache_releases += 1
            self._release_all(small_too=False)
        cache = self.cached[small]
        fits = [i for i, (have, _) in enumerate(cache) if have >= size]
        if fits:
            best = min(fits, key=lambda i: cache[i][0])
            have, heap = cache[best]
            if have <= size + LARGE_HEAP or not any(h.room >= size for h in self.heaps[small]):
                if have > size + LARGE_HEAP:  # oversize and idle, no heap has room: its space is reused
                    self._release(small, best)
                else:
                    cache.pop(best)
                    self.allocated += have
                    self._note()
                    return have, heap, small
        heap = self._place(size, small, pressure)
        heap.room -= size
        heap.buffers += 1
        self.allocated += size
        self._note()
        return size, heap, small

    def _place(self, size: int, small: bool, pressure: bool) -> _Heap:
        roomy = [h for h in self.heaps[small] if h.room >= size]
        if roomy:
            return min(roomy, key=lambda h: h.room)
        new = heap_size(size, pressure=pressure)
        if self.high is not None and self.held + new > self.high:
            self.stats.cache_releases += 1
            self._release_all()
            roomy = [h for h in self.heaps[small] if h.room >= size]
            if roomy:
                return min(roomy, key=lambda h: h.room)
            if self.held + new > self.high:
                raise MpsOutOfMemory(self.stats, size, self.held)
        heap = _Heap(new)
        self.heaps[small].append(heap)
        self.held += new
        self.stats.heaps_opened += 1
        return heap

    def free(self, size: int, heap: _Heap, small: bool) -> None:
        self.allocated -= size
        self.cached[small].append((size, heap))


def replay_mps(ledger, high: int | None = None, low: int | None = None) -> tuple[MpsStats, MpsOutOfMemory | None]:
    """Run a ledger's storage events (as ``estimator/verdict.replay`` does for CUDA) through MPS's heaps under the
    ``high`` and ``low`` watermarks (bytes; None: no limit): (stats, the failure or None)."""
    from memfit.accounting.ledger import ALLOC, FREE, RENAME, storage_events

    allocator = _Allocator(high, low)
    handles: dict[int, tuple] = {}
    records = ledger.records
    try:
        for kind, index in storage_events(ledger):
            if kind == ALLOC:
                handles[index] = allocator.malloc(records[index].nbytes)
            elif kind == RENAME:
                handles[index] = handles.pop(records[index].donor)
            elif kind == FREE and index in handles:
                allocator.free(*handles.pop(index))
    except MpsOutOfMemory as oom:
        return oom.stats, oom
    return allocator.stats, None
