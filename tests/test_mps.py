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


def test_a_profile_on_a_mac_samples_what_mps_says(monkeypatch, capsys, tmp_path):
    """``memfit profile --device mps``'s own pieces (``profiling/mps_memory.py``): torch.mps's current and driver
    figures sampled after every op the watch sees, their highest kept (no peak API before 2.13); 2.13's
    torch.accelerator peaks read where MPS keeps them; a machine without MPS refused in one line. torch.mps is
    stood in for (a CPU machine has none); the ops are a real loop's. Never run on a Mac."""
    import itertools

    import torch

    from memfit.cli import main
    from memfit.profiling import mps_memory
    from memfit.profiling.profile import profile

    if not torch.backends.mps.is_available():
        script = tmp_path / "train.py"
        script.write_text("print('never run')\n")
        assert main(["profile", "--device", "mps", str(script)]) == 2
        err = capsys.readouterr().err
        assert "no MPS device" in err and len(err.strip().splitlines()) == 1, err
    monkeypatch.setattr("memfit.hardware.mps.require_mps", lambda: None)
    with pytest.raises(MemfitError, match="torch.mps.set_per_process_memory_fraction"):
        profile(device="mps", budget="1GiB")
    figures = itertools.cycle([3 * MiB, 7 * MiB, 5 * MiB])  # the highest, 7 MiB, comes second of every three
    calls = []

    def current():
        calls.append(1)
        return next(figures)

    monkeypatch.setattr(torch.mps, "current_allocated_memory", current)
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: 64 * MiB + len(calls))
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 11 * GiB)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with profile(device="mps") as prof:
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    settings = prof.report.settings
    assert prof.steps == 2 and settings["mps_samples"] == len(calls) > 10  # after every op, and once at the start
    assert prof.report.peak_bytes == settings["sampled_peak_current_allocated_memory"] == 7 * MiB
    assert settings["sampled_peak_driver_allocated_memory"] == 64 * MiB + len(calls)
    assert settings["recommended_max_memory"] == 11 * GiB and "lower bound" in " ".join(prof.report.notes)
    # where torch keeps MPS's peaks (2.13's device stats), they are the report's peak, as on CUDA
    stats = type("Accelerator", (), {"reset_peak_memory_stats": staticmethod(lambda: None),
                                     "max_memory_allocated": staticmethod(lambda: 9 * MiB),
                                     "max_memory_reserved": staticmethod(lambda: 96 * MiB)})
    sampler = mps_memory.MpsSampler(accelerator=stats)
    sampler.start()
    assert sampler.fields()["reserved_bytes"] == 96 * MiB and sampler.peak(1)[0] == 9 * MiB
