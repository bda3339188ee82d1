"""hardware/mps.py: MPS's heap sizes, watermarks and a Mac's three outcomes, against cases computed by hand from
torch's source (research/mps/notes.md: MPSAllocator.h lines 140-154 of the 2.13 wheel, MPSAllocator.mm at 57ba412
lines 28-38 and 83-97). Never run on a Mac."""

import pytest

from memfit.errors import MemfitError
from memfit.hardware.mps import GiB, MiB, heap_size, limits, verdict


@pytest.mark.parametrize("size, unified, pressure, heap", [
    (4, True, False, 8 * MiB),  # a scalar-sized request: the small heap
    (1 * MiB, True, False, 8 * MiB),  # kMaxSmallAlloc itself is small
    (1 * MiB + 1, True, False, 32 * MiB),  # past 1 MiB: the 32 MiB large heap
    (10 * MiB - 1, True, False, 32 * MiB),
    (10 * MiB, True, False, 1024 * MiB),  # kMinLargeAlloc up to half of 1 GiB: a whole 1 GiB heap
    (512 * MiB - 1, True, False, 1024 * MiB),
    (512 * MiB, True, False, 512 * MiB),  # half of kXLargeHeap: a heap of its own, 2 MiB multiples
    (700 * MiB + 1, True, False, 702 * MiB),
    (64 * MiB, True, True, 64 * MiB),  # under memory pressure no 1 GiB heap: its own
    (65 * MiB + 3, True, True, 66 * MiB),
    (64 * MiB, False, False, 64 * MiB),  # 2.11's discrete GPUs: half of 128 MiB is 64 MiB
    (63 * MiB, False, False, 128 * MiB),
])
def test_the_heap_a_request_opens(size, unified, pressure, heap):
    assert heap_size(size, unified=unified, pressure=pressure) == heap


def test_watermarks_are_ratios_of_the_recommended_working_set():
    # an 18 GB Mac whose recommended working set is 12 GiB: "max allowed: 20.40 GB" in pytorch/pytorch#130112
    mac = limits(12 * GiB)
    assert mac.high == int(1.7 * 12 * GiB) and round(mac.high / GiB, 2) == 20.40
    assert mac.low == int(1.4 * 12 * GiB)
    assert limits(12 * GiB, high_ratio=0.0).high is None  # no limit: the Mac's RAM decides
    assert limits(12 * GiB, high_ratio=0.0, low_ratio=2.0).low == 24 * GiB
    for bad in (dict(high_ratio=2.5), dict(high_ratio=-1.0), dict(high_ratio=1.0, low_ratio=1.4)):
        with pytest.raises(MemfitError, match="WATERMARK_RATIO"):
            limits(12 * GiB, **bad)
    with pytest.raises(MemfitError, match="positive number of bytes"):
        heap_size(0)


def test_a_mac_fits_fits_by_swapping_or_fails():
    mac = limits(12 * GiB)
    assert verdict(11 * GiB, mac) == ("fits", 0)
    assert verdict(14 * GiB, mac) == ("fits_by_swapping", 2 * GiB)  # past the working set, under 20.4 GiB
    assert verdict(21 * GiB, mac) == ("out_of_memory", 21 * GiB - mac.high)
    assert verdict(40 * GiB, limits(12 * GiB, high_ratio=0.0))[0] == "fits_by_swapping"  # no limit: it swaps


def test_a_run_on_a_mac_its_fraction_its_refusal_and_its_out_of_memory(monkeypatch):
    """``memfit train --device mps``'s device-specific pieces, the rest of the loop is the CPU's and CUDA's: a machine
    without MPS refused in one line (exit 2), a budget as MPS's fraction of the working set (at most 2.0), MPS's
    RuntimeError raised as torch.OutOfMemoryError so the loop's recovery applies. Never run on a Mac."""
    import torch

    from memfit.cli import main
    from memfit.hardware.gpus import this_mac
    from memfit.hardware.mps import memory_fraction, oom_as_torch, require_mps

    if not torch.backends.mps.is_available():
        with pytest.raises(MemfitError, match="no MPS device"):
            require_mps()
        assert main(["train", "gpt2", "--device", "mps", "--data", "x.bin", "--seq-len", "64"]) == 2
    assert memory_fraction(24 * GiB, 16 * GiB) == 1.5
    with pytest.raises(MemfitError, match="at most"):
        memory_fraction(40 * GiB, 16 * GiB)
    message = ("MPS backend out of memory (MPS allocated: 9.48 GiB, other allocations: 480.00 KiB, max allowed: "
               "9.47 GiB). Tried to allocate 64.00 MiB on shared pool.")
    with pytest.raises(torch.OutOfMemoryError, match="MPS backend out of memory"):
        with oom_as_torch():
            raise RuntimeError(message)
    with pytest.raises(RuntimeError, match="something else"):
        with oom_as_torch():
            raise RuntimeError("something else")
    # this Mac as MPS sees it: its RAM and Metal's own working set
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 11 * GiB, raising=False)
    mac = this_mac()
    assert mac.vendor == "apple" and mac.working_set_bytes == 11 * GiB and mac.name.startswith("mac-")
