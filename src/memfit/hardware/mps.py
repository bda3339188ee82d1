"""Apple silicon's MPS allocator as PyTorch's source writes it: heap sizes, its limits, and what they mean on a Mac.

The rules, for torch 2.11 and 2.13 (``research/mps/notes.md`` holds every citation; the lines below are of the
2.13 wheel's ``torch/include/ATen/mps/MPSAllocator.h`` unless named, and of ``aten/src/ATen/mps/MPSAllocator.mm``
at 57ba412 for 2.11):

* **Heaps** (``HeapBlock::createHeapBlock``, header lines 140-154): a request of at most 1 MiB (``kMaxSmallAlloc``)
  opens an 8 MiB heap (``kSmallHeap``), one under 10 MiB (``kMinLargeAlloc``) a 32 MiB heap (``kLargeHeap``), one
  under half of ``kXLargeHeap`` (1 GiB on unified memory; 2.11's discrete GPUs 128 MiB) with no memory pressure a
  whole ``kXLargeHeap``, anything else a heap of its own rounded up to 2 MiB (``kRoundLarge``). A heap with any live
  buffer stays whole: a 1 GiB heap holding one small tensor keeps its 1 GiB.
* **Limits** (``init_allocator``, .mm lines 28-38 and 83-97): the high watermark, ``PYTORCH_MPS_HIGH_WATERMARK_RATIO``
  (default 1.7, at most 2.0, 0 = none) times Metal's ``recommendedMaxWorkingSetSize``, is a hard limit on what
  Metal holds for the process (torch's heaps and MPSGraph's own): past it an allocation raises "MPS backend out of
  memory". The low watermark, ``PYTORCH_MPS_LOW_WATERMARK_RATIO`` (default 1.4 on unified memory), starts the
  cache's garbage collection. ``torch.mps.set_per_process_memory_fraction(f)`` sets the high ratio to ``f``.
* **What a Mac does** (``verdict``): within the recommended working set the GPU's memory is its own; past it, and
  under the high watermark, macOS gives the GPU more of the shared RAM and swaps what else lived there: the run
  fits only by swapping, slower by how far it is past; past the high watermark it fails.

* **A run on a Mac** (``memfit train --device mps``): ``require_mps`` refuses a machine without MPS in one line; a budget
  becomes ``torch.mps.set_per_process_memory_fraction(memory_fraction(budget, recommended))`` (the high watermark at
  the budget); MPS's allocator raises its out-of-memory as a ``RuntimeError`` (``TORCH_CHECK``), which ``oom_as_torch``
  turns into ``torch.OutOfMemoryError`` so the loop's recovery (a smaller micro-batch, the batch redone) applies.

The replay of a step's allocations through these heaps is ``accounting/mps_heaps.py``. Left out here: the
alignment Metal adds to each buffer (``heapBufferSizeAndAlignWithLength``: a device's answer, not torch's), the
bucketed rounding upstream after 2.13, MPSGraph's own allocations ("other allocations" in its message), and the
RAM macOS keeps for itself. Never run on a Mac: the rules are read from the source and the test cases computed by
hand from it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from memfit.errors import MemfitError

__all__ = ["heap_size", "MpsLimits", "limits", "verdict", "MiB", "GiB", "require_mps", "memory_fraction", "oom_as_torch",
           "is_mps_oom", "environment_ratios", "environment_limits", "HIGH_ENV", "LOW_ENV"]

MiB, GiB = 1 << 20, 1 << 30
MAX_SMALL_ALLOC = 1 * MiB  # kMaxSmallAlloc
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc
ROUND_LARGE = 2 * MiB  # kRoundLarge
SMALL_HEAP = 8 * MiB  # kSmallHeap
LARGE_HEAP = 32 * MiB  # kLargeHeap
XLARGE_HEAP_UNIFIED = 1024 * MiB  # kXLargeHeap (2.13; kXLargeHeapU in 2.11)
XLARGE_HEAP_DISCRETE = 128 * MiB  # kXLargeHeapD (2.11 only: 2.13 refuses a Mac without unified memory)
HIGH_RATIO, HIGH_RATIO_MOST, LOW_RATIO = 1.7, 2.0, 1.4  # default_high_watermark_ratio, its upper bound, the low one
HIGH_ENV, LOW_ENV = "PYTORCH_MPS_HIGH_WATERMARK_RATIO", "PYTORCH_MPS_LOW_WATERMARK_RATIO"


def heap_size(size: int, *, unified: bool = True, pressure: bool = False) -> int:
    """Bytes of the heap a new ``size``-byte buffer (already aligned) opens (``createHeapBlock``)."""
    if not isinstance(size, int) or size <= 0:
        raise MemfitError(f"heap_size takes a positive number of bytes, got {size!r}")
    xlarge = XLARGE_HEAP_UNIFIED if unified else XLARGE_HEAP_DISCRETE
    if size <= MAX_SMALL_ALLOC:
        return SMALL_HEAP
    if size < MIN_LARGE_ALLOC:
        return LARGE_HEAP
    if size < xlarge // 2 and not pressure:
        return xlarge
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(frozen=True)
class MpsLimits:
    """What MPS lets a process hold, from Metal's recommended working set (bytes)."""

    recommended: int  # recommendedMaxWorkingSetSize
    high: int | None  # the hard limit (None: PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0, no limit)
    low: int | None  # where garbage collection of the cache starts (None: disabled)


def limits(recommended: int, high_ratio: float = HIGH_RATIO, low_ratio: float = LOW_RATIO) -> MpsLimits:
    """The watermarks for ``recommended`` bytes of working set, the ratios as their environment variables take them
    (``init_allocator``: high in [0, 2], low in [0, high], or [0, 2] when high is 0)."""
    if not 0.0 <= high_ratio <= HIGH_RATIO_MOST:
        raise MemfitError(f"PYTORCH_MPS_HIGH_WATERMARK_RATIO={high_ratio} is outside 0.0-2.0 (torch refuses it): "
                          "use 1.7 (its default), up to 2.0, or 0.0 for no limit")
    if not 0.0 <= low_ratio <= (high_ratio or HIGH_RATIO_MOST):
        raise MemfitError(f"PYTORCH_MPS_LOW_WATERMARK_RATIO={low_ratio}{' (its default)' if low_ratio == LOW_RATIO else ''}"
                          f" is above the high ratio {high_ratio or HIGH_RATIO_MOST}, and torch refuses that at start-up "
                          f"(\"invalid low watermark ratio\"): set PYTORCH_MPS_LOW_WATERMARK_RATIO to at most "
                          f"{high_ratio or HIGH_RATIO_MOST} too")
    return MpsLimits(recommended, int(high_ratio * recommended) if high_ratio else None,
                     int(low_ratio * recommended) if low_ratio else None)


def environment_ratios(environ=None) -> tuple[float, float]:
    """(high, low): the watermark ratios MPS reads at start-up (``init_allocator``), from the environment memfit runs
    in, where a user sets them as for the run; each unset one its default. A value that is not a plain number is
    refused: torch's ``strtod`` reads it (and an empty one) as 0.0, which for the high watermark is no limit at all."""
    environ = os.environ if environ is None else environ
    found = []
    for name, default, zero in ((HIGH_ENV, HIGH_RATIO, "no limit at all"), (LOW_ENV, LOW_RATIO, "no garbage collection")):
        text = environ.get(name)
        if text is None:
            found.append(default)
            continue
        try:
            found.append(float(text))
        except ValueError:
            raise MemfitError(f"{name}={text!r} is not a number: torch would read it as 0.0 ({zero}); set a ratio "
                              f"such as {default} (its default) or unset it") from None
    return found[0], found[1]


def environment_limits(recommended: int, environ=None) -> MpsLimits:
    """``limits`` with the ratios of ``environment_ratios``: what this process's environment gives a Mac."""
    return limits(recommended, *environment_ratios(environ))


def verdict(held: int, mac: MpsLimits) -> tuple[str, int]:
    """(``fits`` | ``fits_by_swapping`` | ``out_of_memory``, bytes past the line that decided): what Metal holds for
    the step (``held``) against the recommended working set and the high watermark."""
    if mac.high is not None and held > mac.high:
        return "out_of_memory", held - mac.high
    if held > mac.recommended:
        return "fits_by_swapping", held - mac.recommended
    return "fits", 0


MPS_OOM = "MPS backend out of memory"


def require_mps() -> None:
    """Refuse, in one line, a run on ``mps`` where torch has no MPS device."""
    import torch

    if not torch.backends.mps.is_available():
        raise MemfitError("--device mps: this machine has no MPS device (torch.backends.mps.is_available() is False): "
                          "run it on an Apple silicon Mac with macOS 14 or later, or use --device cpu or cuda")


def memory_fraction(budget: int, recommended: int) -> float:
    """The ratio ``torch.mps.set_per_process_memory_fraction`` takes for a ``budget`` of bytes on a Mac whose Metal
    working set is ``recommended`` (``torch.mps.recommended_max_memory()``): at most 2.0, as torch allows."""
    from memfit.units import format_size

    if not isinstance(budget, int) or isinstance(budget, bool):
        raise MemfitError(f"budget must be a number of bytes, got {budget!r}: pass an int or a size like '24GiB'")
    ratio = budget / recommended
    if not 0 < ratio <= HIGH_RATIO_MOST:
        raise MemfitError(f"a budget of {format_size(budget)} is {ratio:.2f} x the Mac's {format_size(recommended)} "
                          f"working set; MPS allows up to {HIGH_RATIO_MOST} x: give at most "
                          f"{format_size(int(HIGH_RATIO_MOST * recommended))}")
    return ratio


def is_mps_oom(err: BaseException) -> bool:
    return isinstance(err, RuntimeError) and MPS_OOM in str(err)


class oom_as_torch:
    """Inside, MPS's out-of-memory ``RuntimeError`` is raised as ``torch.OutOfMemoryError`` (its message kept)."""

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        import torch

        if err is not None and not isinstance(err, torch.OutOfMemoryError) and is_mps_oom(err):
            raise torch.OutOfMemoryError(str(err)) from err
        return False
