"""The CUDA caching-allocator model against scenarios worked out by hand from the torch source.

Every expected number is written out with the rule that produces it (names as in
c10/cuda/CUDACachingAllocator.cpp): kMinBlockSize 512 B, kSmallSize 1 MiB, kSmallBuffer 2 MiB,
kLargeBuffer 20 MiB, kMinLargeAlloc 10 MiB, kRoundLarge 2 MiB.
"""

from __future__ import annotations

import pytest

from memfit.accounting.cuda_allocator import (
    CachingAllocator,
    SimulatedOutOfMemory,
    get_allocation_size,
    round_size,
    simulate,
)

KiB, MiB = 1 << 10, 1 << 20


def blocks(allocator):
    """[(segment size, ((block size, allocated), ...)), ...] by address."""
    return [(s.size, s.blocks) for s in allocator.snapshot()]


# ------------------------------------------------------------------------------------ sizes


def test_round_size():
    assert round_size(1) == 512  # below kMinBlockSize: one 512 B block
    assert round_size(512) == 512
    assert round_size(513) == 1024  # next multiple of 512
    assert round_size(4 * KiB) == 4 * KiB
    assert round_size(MiB + 1) == MiB + 512


def test_round_size_power2_divisions():
    # 4 divisions: 5 MiB + 1 lies between 4 and 8 MiB, whose quarters are 1 MiB apart -> 6 MiB
    assert round_size(5 * MiB + 1, roundup_power2_divisions=4) == 6 * MiB
    # 3000 B > 4 * 512: between 2048 and 4096 in 512 B steps -> 3072
    assert round_size(3000, roundup_power2_divisions=4) == 3072
    # 1200 B is not above 4 * 512, so plain 512 B rounding applies -> 1536
    assert round_size(1200, roundup_power2_divisions=4) == 1536
    table = {64: 8, 128: 2, ">": 1}  # torch's "[64:8,128:2,>:1]": 8 up to 64 MiB, 2 at 128 MiB, 1 above
    assert round_size(33 * MiB, roundup_power2_divisions=table) == 36 * MiB  # 32..64 MiB in 4 MiB steps
    assert round_size(129 * MiB, roundup_power2_divisions=table) == 192 * MiB  # 128..256 MiB in 64 MiB steps
    assert round_size(300 * MiB + 1, roundup_power2_divisions=table) == 300 * MiB + 512  # 1 division: 512 B


def test_allocation_size():
    assert get_allocation_size(512) == 2 * MiB  # small pool: kSmallBuffer
    assert get_allocation_size(MiB) == 2 * MiB  # 1 MiB is still "small"
    assert get_allocation_size(MiB + 512) == 20 * MiB  # large, under 10 MiB: kLargeBuffer
    assert get_allocation_size(10 * MiB) == 10 * MiB  # 10 MiB and up: rounded to 2 MiB
    assert get_allocation_size(11 * MiB) == 12 * MiB


# ------------------------------------------------------------------------------------ pools


def test_small_request_creates_2mib_segment_and_second_one_splits_it():
    a = CachingAllocator()
    a.malloc(1)
    s = a.stats
    assert (s.allocated, s.requested, s.reserved, s.segments) == (512, 1, 2 * MiB, 1)
    a.malloc(1000)  # 1000 -> 1024; best fit is the 2 MiB - 512 tail of the same segment
    s = a.stats
    assert (s.allocated, s.reserved, s.segments) == (512 + 1024, 2 * MiB, 1)
    # small pool splits any remainder >= 512 B
    assert blocks(a) == [(2 * MiB, ((512, True), (1024, True), (2 * MiB - 1536, False)))]


def test_5mib_request_takes_a_20mib_segment_and_the_next_one_splits_it():
    a = CachingAllocator()
    a.malloc(5 * MiB)  # 1 MiB < 5 MiB < 10 MiB: kLargeBuffer segment, remainder 15 MiB > 1 MiB -> split
    assert (a.stats.reserved, a.stats.allocated) == (20 * MiB, 5 * MiB)
    a.malloc(5 * MiB)  # best fit: the 15 MiB tail
    assert (a.stats.reserved, a.stats.allocated, a.stats.segments) == (20 * MiB, 10 * MiB, 1)
    assert blocks(a) == [(20 * MiB, ((5 * MiB, True), (5 * MiB, True), (10 * MiB, False)))]


def test_12mib_request_gets_its_own_12mib_segment():
    a = CachingAllocator()
    a.malloc(12 * MiB)  # >= 10 MiB: segment is the size rounded to 2 MiB, nothing left to split
    assert (a.stats.reserved, a.stats.allocated, a.stats.segments) == (12 * MiB, 12 * MiB, 1)
    a.malloc(11 * MiB)  # 12 MiB segment; the 1 MiB left is not > kSmallSize: handed out unsplit
    assert (a.stats.reserved, a.stats.allocated, a.stats.requested) == (24 * MiB, 24 * MiB, 23 * MiB)
    assert blocks(a) == [(12 * MiB, ((12 * MiB, True),)), (12 * MiB, ((12 * MiB, True),))]


def test_large_block_is_split_only_when_more_than_1mib_remains():
    a = CachingAllocator()
    a.free(a.malloc(5 * MiB))  # leaves one cached, whole 20 MiB block
    a.malloc(19 * MiB)  # remainder exactly 1 MiB: not > kSmallSize -> whole 20 MiB block is allocated
    assert (a.stats.allocated, a.stats.requested, a.stats.reserved) == (20 * MiB, 19 * MiB, 20 * MiB)

    b = CachingAllocator()
    b.free(b.malloc(5 * MiB))
    b.malloc(18 * MiB + 512 * KiB)  # remainder 1.5 MiB > 1 MiB -> split
    assert b.stats.allocated == 18 * MiB + 512 * KiB
    assert blocks(b) == [(20 * MiB, ((18 * MiB + 512 * KiB, True), (MiB + 512 * KiB, False)))]


def test_free_merges_neighbours_so_a_bigger_request_fits():
    a = CachingAllocator()
    x, y = a.malloc(5 * MiB), a.malloc(5 * MiB)
    a.malloc(10 * MiB)  # takes the 10 MiB tail exactly (no remainder): segment is full
    a.free(x)
    a.free(y)  # merges with the free 5 MiB before it: one 10 MiB free block
    assert blocks(a) == [(20 * MiB, ((10 * MiB, False), (10 * MiB, True)))]
    a.malloc(9 * MiB)  # fits the merged 10 MiB block; two 5 MiB holes would have needed a new segment
    # its 1 MiB remainder is not > kSmallSize: handed out with it
    assert (a.stats.reserved, a.stats.segments, a.stats.allocated) == (20 * MiB, 1, 20 * MiB)


def test_streams_do_not_share_cached_blocks():
    events = [("alloc", "a", 1024, 0), ("free", "a"), ("alloc", "b", 1024, 1)]
    s = simulate(events)
    assert (s.reserved, s.segments) == (4 * MiB, 2)  # stream 1 cannot reuse stream 0's 2 MiB segment


def test_zero_byte_request_takes_nothing():
    a = CachingAllocator()
    a.free(a.malloc(0))
    assert a.stats.reserved == 0 and a.stats.num_device_alloc == 0


# ------------------------------------------------------------------------------------ caching


def _step(tag):
    """One training-step-like pattern: weights-grad-sized buffers, activations, temporaries."""
    return [
        ("alloc", f"{tag}act1", 6 * MiB), ("alloc", f"{tag}act2", 14 * MiB), ("alloc", f"{tag}tmp", 300 * KiB),
        ("alloc", f"{tag}act3", 3 * MiB), ("free", f"{tag}tmp"), ("alloc", f"{tag}grad", 14 * MiB),
        ("free", f"{tag}act3"), ("free", f"{tag}act2"), ("alloc", f"{tag}tmp2", 700), ("free", f"{tag}act1"),
        ("free", f"{tag}grad"), ("free", f"{tag}tmp2"),
    ]


def test_second_identical_step_reuses_the_cache():
    a = CachingAllocator()
    live = {}

    def run(events):
        for e in events:
            if e[0] == "alloc":
                live[e[1]] = a.malloc(e[2])
            else:
                a.free(live.pop(e[1]))

    run(_step("1"))
    first = a.stats
    run(_step("2"))
    second = a.stats
    # step 1: act1 6 MiB -> 20 MiB segment A (14 MiB left); act2 14 MiB fills A's tail exactly;
    # tmp 300 KiB -> 2 MiB small segment; act3 3 MiB -> 20 MiB segment B; grad 14 MiB -> B's 17 MiB tail.
    assert first.peak_reserved == (20 + 2 + 20) * MiB
    assert first.peak_allocated == (6 + 14 + 3 + 14) * MiB  # tmp was freed before grad came
    # step 2 finds A, B and the small segment cached and whole again: nothing new is cudaMalloc-ed
    assert second.peak_reserved == first.peak_reserved
    assert second.num_device_alloc == first.num_device_alloc == 3
    assert second.peak_allocated == first.peak_allocated


def test_empty_cache_releases_only_wholly_free_segments():
    a = CachingAllocator()
    a.malloc(5 * MiB)  # 20 MiB segment, 15 MiB of it free
    a.free(a.malloc(16 * MiB))  # more than that 15 MiB: a 16 MiB segment of its own, then wholly free
    a.empty_cache()  # cudaFree the 16 MiB one; the split 20 MiB one stays
    s = a.stats
    assert (s.reserved, s.num_device_free, s.segments, s.peak_reserved) == (20 * MiB, 1, 1, 36 * MiB)
    a.reset_peak_stats()
    assert (a.stats.peak_reserved, a.stats.peak_allocated) == (20 * MiB, 5 * MiB)


# ------------------------------------------------------------------------------------ capacity


def test_capacity_releases_cached_segments_then_retries():
    a = CachingAllocator(capacity=24 * MiB)
    a.free(a.malloc(12 * MiB))  # a cached, wholly free 12 MiB segment
    a.malloc(14 * MiB)  # too big for it; 12 + 14 > 24 -> release the cached segment, retry: fits
    s = a.stats
    assert (s.reserved, s.allocated, s.segments) == (14 * MiB, 14 * MiB, 1)
    assert (s.num_alloc_retries, s.num_device_free, s.num_device_alloc) == (1, 1, 2)
    assert s.peak_reserved == 14 * MiB  # never both at once


def test_out_of_memory_when_nothing_cached_can_go():
    a = CachingAllocator(capacity=24 * MiB)
    a.malloc(12 * MiB)
    with pytest.raises(SimulatedOutOfMemory) as err:
        a.malloc(14 * MiB)  # 12 MiB live + 14 MiB segment > 24 MiB, nothing free to release
    assert err.value.alloc_size == 14 * MiB
    assert err.value.stats.reserved == 12 * MiB
    assert a.stats.num_ooms == 1 and a.stats.num_alloc_retries == 1


def test_a_partly_used_segment_is_not_released():
    a = CachingAllocator(capacity=30 * MiB)
    a.malloc(5 * MiB)  # 20 MiB segment, 15 MiB of it free but split: it cannot be cudaFree-d
    with pytest.raises(SimulatedOutOfMemory):
        a.malloc(16 * MiB)  # 16 MiB segment: 20 + 16 > 30
    assert a.stats.reserved == 20 * MiB


def test_simulate_raises_oom_too():
    with pytest.raises(SimulatedOutOfMemory):
        simulate([("alloc", 1, 30 * MiB)], capacity=20 * MiB)


# ------------------------------------------------------------------------------------ max_split_size


def test_max_split_size_keeps_oversize_blocks_for_large_requests():
    a = CachingAllocator(max_split_size=40 * MiB)
    a.free(a.malloc(50 * MiB))  # a 50 MiB oversize cached block
    a.malloc(5 * MiB)  # a request under max_split_size may not take it: new 20 MiB segment
    assert a.stats.reserved == 70 * MiB
    h = a.malloc(45 * MiB)  # >= max_split_size and 50 < 45 + 20: takes the block whole, unsplit
    assert (a.stats.reserved, a.stats.allocated) == (70 * MiB, 50 * MiB + 5 * MiB)
    a.free(h)
    a.malloc(42 * MiB + 512)  # rounds to 42 MiB + 512; unsplit too (oversize blocks never split)
    assert a.stats.allocated == 55 * MiB


def test_max_split_size_frees_one_oversize_block_before_everything():
    a = CachingAllocator(max_split_size=40 * MiB, capacity=80 * MiB)
    a.free(a.malloc(50 * MiB))
    a.free(a.malloc(2 * MiB))  # 20 MiB segment, cached and whole
    # 35 MiB: may not use the oversize block; 36 MiB segment -> 50 + 20 + 36 > 80.
    # release_available_cached_blocks frees the smallest oversize block >= max(35, 40) MiB (the
    # 50 MiB one) and the retry fits; the 20 MiB segment stays cached, no full flush (no retry count).
    a.malloc(35 * MiB)
    s = a.stats
    assert (s.reserved, s.num_device_free, s.num_alloc_retries) == (56 * MiB, 1, 0)


def test_max_split_size_must_be_at_least_20mib():
    with pytest.raises(ValueError):
        CachingAllocator(max_split_size=10 * MiB)


# ------------------------------------------------------------------------------------ fragmentation


def _growing_batch():
    """Four 12 MiB activations, freed, then four 14 MiB ones (the next, slightly bigger batch)."""
    events = [("alloc", f"a{i}", 12 * MiB) for i in range(4)] + [("free", f"a{i}") for i in range(4)]
    events += [("alloc", f"b{i}", 14 * MiB) for i in range(4)] + [("free", f"b{i}") for i in range(4)]
    return events


def test_fragmentation_of_the_default_allocator():
    s = simulate(_growing_batch())
    # each 12 MiB request: its own 12 MiB segment; each 14 MiB one finds only 12 MiB blocks: 4 more
    assert s.peak_reserved == 4 * 12 * MiB + 4 * 14 * MiB
    assert s.peak_allocated == 4 * 14 * MiB
    assert s.fragmentation_at_peak == 4 * 12 * MiB  # the four cached 12 MiB segments, all unusable
    assert s.largest_free_at_peak == 12 * MiB
    assert s.peak_segments == 8


def test_expandable_segments_reserve_allocated_rounded_to_pages():
    s = simulate(_growing_batch(), expandable_segments=True)
    # one segment of 20 MiB pages: 4 x 12 = 48 MiB maps 3 pages (60 MiB); freed, it merges into one
    # 60 MiB block where 4 x 14 = 56 MiB fit: reserved = 56 MiB rounded up to 20 MiB pages
    assert s.peak_reserved == 60 * MiB
    assert s.peak_allocated == 56 * MiB
    assert s.fragmentation_at_peak == 4 * MiB
    assert s.segments == 1 and s.num_device_alloc == 3


def test_expandable_segments_grow_from_the_free_tail():
    a = CachingAllocator(expandable_segments=True)
    a.malloc(5 * MiB)  # maps one 20 MiB page; any remainder >= 512 B is split off: 15 MiB free
    assert (a.stats.reserved, a.stats.allocated) == (20 * MiB, 5 * MiB)
    a.malloc(30 * MiB)  # the 15 MiB free tail + one more page (15 MiB short -> 20 MiB): 35 MiB, 5 left
    assert (a.stats.reserved, a.stats.allocated) == (40 * MiB, 35 * MiB)
    assert blocks(a) == [(40 * MiB, ((5 * MiB, True), (30 * MiB, True), (5 * MiB, False)))]
    a.malloc(3000)  # small pool: its own expandable segment, 2 MiB pages
    assert a.stats.reserved == 42 * MiB


def test_expandable_segments_unmap_only_whole_free_pages():
    a = CachingAllocator(expandable_segments=True)
    h = [a.malloc(5 * MiB) for _ in range(5)]  # 25 MiB over two 20 MiB pages
    for x in h[:4]:
        a.free(x)  # the first 20 MiB (page 0) is free
    a.empty_cache()
    assert (a.stats.reserved, a.stats.num_device_free) == (20 * MiB, 1)  # page 0 unmapped, page 1 stays
    a.free(h[4])
    a.empty_cache()
    assert (a.stats.reserved, a.stats.segments) == (0, 0)


def test_expandable_segments_release_pages_under_capacity():
    a = CachingAllocator(expandable_segments=True, capacity=40 * MiB)
    keep = a.malloc(2 * MiB)  # page 0
    tmp = a.malloc(30 * MiB)  # the 18 MiB tail of page 0 is 12 MiB short: page 1 is mapped
    assert a.stats.reserved == 40 * MiB
    a.free(tmp)
    a.malloc(3000)  # small pool wants a 2 MiB page: 42 MiB > 40 -> unmap the free page 1, retry
    assert (a.stats.reserved, a.stats.num_alloc_retries) == (22 * MiB, 1)
    a.free(keep)


# ------------------------------------------------------------------------------------ memory fraction, gc


def test_memory_fraction_checks_the_whole_alloc_size_even_with_expandable_segments():
    # alloc_block refuses when total_allocated_memory + alloc_size > allowed_memory_maximum, before
    # looking at expandable segments: a 30 MiB request has alloc_size 30 MiB, though growing the
    # segment would map only one more 20 MiB page.
    def run(**limit):
        a = CachingAllocator(expandable_segments=True, **limit)
        a.malloc(5 * MiB)  # page 0 (20 MiB), 15 MiB of it free
        a.malloc(30 * MiB)  # needs the 15 MiB tail + one page: reserved 40 MiB
        return a.stats

    assert run(capacity=40 * MiB).peak_reserved == 40 * MiB  # the device itself: the page fits
    with pytest.raises(SimulatedOutOfMemory) as err:
        run(allowed_memory=40 * MiB)  # 20 + 30 > 40: refused; no whole free page to unmap; retry refused
    assert err.value.stats.reserved == 20 * MiB and err.value.stats.num_alloc_retries == 1


def _aging(threshold, allowed=100 * MiB):
    """Four cached segments of different ages, then a request none of them serves."""
    a = CachingAllocator(allowed_memory=allowed, garbage_collection_threshold=threshold)
    h = a.malloc(12 * MiB)  # get_free_block call 1 on the large pool; segment A
    a.free(h)  # A enters the free set at count 1
    b = a.malloc(14 * MiB)  # call 2: A (12) too small; segment B
    c = a.malloc(16 * MiB)  # call 3: segment C
    a.free(b)
    a.free(c)  # B and C enter at count 3
    d = a.malloc(18 * MiB)  # call 4: nothing fits; reserved 42 MiB is not over the threshold yet
    a.free(d)  # D enters at count 4
    a.malloc(30 * MiB)  # call 5: ages A 4, B 2, C 2, D 1; reserved 60 MiB
    return a.stats


def test_garbage_collection_frees_old_segments_until_under_the_threshold():
    # threshold 0.5 x 100 MiB = 50 MiB; 60 MiB reserved: 10 MiB to reclaim. Mean age 9/4 = 2.25:
    # only A (age 4, 12 MiB) is that old, and freeing it reclaims enough. Then E takes 30 MiB.
    s = _aging(0.5)
    assert (s.reserved, s.num_device_free) == ((14 + 16 + 18 + 30) * MiB, 1)


def test_garbage_collection_passes_again_with_the_mean_of_what_is_left():
    # threshold 0.4 x 100 MiB = 40 MiB: 20 MiB to reclaim. Pass 1 (mean 2.25) frees A: 12 MiB.
    # Pass 2: B, C, D have ages 2, 2, 1, mean 5/3: B and C go (a pass does not stop at the target):
    # 42 MiB reclaimed; D stays. Then E.
    s = _aging(0.4)
    assert (s.reserved, s.num_device_free) == ((18 + 30) * MiB, 3)


def test_garbage_collection_needs_a_memory_fraction():
    # torch ignores garbage_collection_threshold unless set_per_process_memory_fraction was called
    a = CachingAllocator(garbage_collection_threshold=0.4)
    h = a.malloc(12 * MiB)
    a.free(h)
    a.malloc(30 * MiB)
    assert (a.stats.reserved, a.stats.num_device_free) == (42 * MiB, 0)
    assert _aging(0.0).num_device_free == 0  # threshold 0 is off
    with pytest.raises(ValueError):
        CachingAllocator(allowed_memory=MiB, garbage_collection_threshold=1.0)


def test_garbage_collection_leaves_split_segments():
    a = CachingAllocator(allowed_memory=60 * MiB, garbage_collection_threshold=0.3)
    a.malloc(5 * MiB)  # a 20 MiB segment, split (15 MiB free): cannot be freed
    a.free(a.malloc(16 * MiB))  # too big for the 15 MiB tail: a 16 MiB segment, then cached whole
    a.malloc(18 * MiB)  # no block fits; 36 MiB > 0.3 x 60 = 18 MiB: only the 16 MiB segment can go,
    # 16 MiB is short of the 18 MiB target but nothing else is freeable; then an 18 MiB segment
    assert (a.stats.reserved, a.stats.num_device_free) == ((20 + 18) * MiB, 1)


def _fragmenting():
    """A 40 MiB segment reused for 12 MiB (28 MiB left, split), then 30 MiB: the default allocator
    needs a new segment and cannot free the split one; expandable segments grow the free tail."""
    return [("alloc", "x", 40 * MiB), ("free", "x"), ("alloc", "y", 12 * MiB), ("alloc", "z", 30 * MiB)]


def test_fragmentation_out_of_memory_that_expandable_segments_avoid():
    assert simulate(_fragmenting()).peak_reserved == 70 * MiB  # 40 + 30 with memory to spare
    with pytest.raises(SimulatedOutOfMemory) as err:
        simulate(_fragmenting(), capacity=64 * MiB)  # 40 + 30 > 64; the 40 MiB segment is split
    assert (err.value.stats.reserved, err.value.stats.num_alloc_retries) == (40 * MiB, 1)
    # expandable: 40 MiB = pages 0-1; y at the start, 28 MiB free up to the unmapped range; z takes
    # those 28 MiB plus 2 MiB of page 2: reserved 60 MiB
    s = simulate(_fragmenting(), capacity=64 * MiB, expandable_segments=True)
    assert (s.peak_reserved, s.peak_allocated, s.num_alloc_retries) == (60 * MiB, 42 * MiB, 0)
    # at 50 MiB: page 1 is wholly free and is unmapped on the retry, but z still needs pages 1-2
    with pytest.raises(SimulatedOutOfMemory) as err:
        simulate(_fragmenting(), capacity=50 * MiB, expandable_segments=True)
    assert err.value.stats.num_device_free == 1 and err.value.stats.reserved == 20 * MiB
