"""How the CUDA caching allocator's segments are given back, and how expandable segments grow.

The request logic is in ``cuda_allocator.py`` (see its docstring for the rules, with torch's names);
this mixin of :class:`~memfit.accounting.cuda_allocator.CachingAllocator` holds the rest of a
segment's life, with the functions of ``c10/cuda/CUDACachingAllocator.cpp`` they follow:

* giving memory back to the device: ``garbage_collect_cached_blocks`` (only with a memory fraction
  and ``garbage_collection_threshold``), ``release_available_cached_blocks`` (oversize blocks, with
  ``max_split_size``), ``release_cached_blocks`` (every wholly free segment, every free page),
  ``release_block``;
* ``expandable_segments``: ``find_expandable_block``, ``try_allocate_expandable_block``,
  ``map_block`` and ``unmap_block`` (pages of 2 MiB in the small pool, 20 MiB in the large one).
"""

from __future__ import annotations

from memfit.accounting.cuda_blocks import _UNLIMITED, _VA_SIZE, _Block, _Pool, _Segment, kLargeBuffer, kSmallBuffer

__all__: list[str] = []


class _Segments:
    """Release and expandable-segment methods of ``CachingAllocator`` (which holds the state)."""

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
