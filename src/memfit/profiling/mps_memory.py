"""What MPS says of its own memory while ``memfit.profile`` watches a loop on an Apple silicon Mac.

``torch.mps`` gives the allocator's figures now, never their peak: ``current_allocated_memory`` (the buffers live
tensors hold), ``driver_allocated_memory`` (everything Metal holds for the process: MPS's heaps with their cached
buffers, and MPSGraph's own) and ``recommended_max_memory`` (Metal's working set). So the profile samples the first two
after every op it watches and keeps the highest of each: its own peak, a lower bound of the true one (an op's
temporaries come and go inside it). From torch 2.13 MPS also fills the device statistics behind
``torch.accelerator.max_memory_allocated`` / ``max_memory_reserved`` (``MPSHeapAllocatorImpl::getDeviceStats``);
where they answer, they are read as well and are the report's peak, as ``max_memory_allocated`` is on CUDA.

Why by hand: no torch API keeps a peak of the driver's figure, and torch 2.11's MPS none at all. Left out: Metal's
own view of the process (Instruments' "GPU memory"), which counts what the process maps beside the driver's figure.
Never run on a Mac: the tests drive it with a stand-in for ``torch.mps``; docs/accelerators.md says so.
"""

from __future__ import annotations

__all__ = ["MpsSampler"]


class MpsSampler:
    """The highest ``current_allocated_memory`` and ``driver_allocated_memory`` seen by ``sample``, and torch's own
    peaks where it keeps them. ``mps`` / ``accelerator``: stand-ins for ``torch.mps`` / ``torch.accelerator``."""

    def __init__(self, mps=None, accelerator=None):
        import torch

        self._mps = torch.mps if mps is None else mps
        self._accelerator = getattr(torch, "accelerator", None) if accelerator is None else accelerator
        self.samples = 0
        self.peak_allocated = self.peak_driver = self.at_start_driver = 0
        self._peaks = False  # torch keeps MPS's peaks (2.13's device stats)

    def start(self) -> None:
        """From here on: torch's peaks reset where it keeps them, and the first sample."""
        try:
            self._accelerator.reset_peak_memory_stats()
            self._accelerator.max_memory_allocated()
            self._peaks = True
        except (AttributeError, RuntimeError, TypeError, ValueError):  # torch 2.11's MPS: no device stats
            self._peaks = False
        self.sample()
        self.at_start_driver = self.peak_driver

    def sample(self) -> None:
        allocated, driver = self._mps.current_allocated_memory(), self._mps.driver_allocated_memory()
        self.samples += 1
        if allocated > self.peak_allocated:
            self.peak_allocated = allocated
        if driver > self.peak_driver:
            self.peak_driver = driver

    def fields(self) -> dict:
        """The profile report's MPS fields: ``settings`` (each figure by its torch name) and ``reserved_bytes``."""
        settings = {"sampled_peak_current_allocated_memory": self.peak_allocated,
                    "sampled_peak_driver_allocated_memory": self.peak_driver,
                    "driver_allocated_memory_at_start": self.at_start_driver,
                    "recommended_max_memory": self._mps.recommended_max_memory(), "mps_samples": self.samples}
        reserved = self.peak_driver
        if self._peaks:
            settings["max_memory_allocated"] = self._accelerator.max_memory_allocated()
            settings["max_memory_reserved"] = reserved = self._accelerator.max_memory_reserved()
        return {"settings": settings, "reserved_bytes": reserved}

    def peak(self, ledger_peak: int) -> tuple[int, str]:
        """The report's peak and a note saying whose it is: torch's ``max_memory_allocated`` where it keeps one, else
        the sampled peak of ``current_allocated_memory`` (else the ledger's tensor bytes, when nothing was sampled)."""
        from memfit.units import format_size

        if self._peaks:
            return (self._accelerator.max_memory_allocated(),
                    "peak: MPS's max_memory_allocated (torch.accelerator); categories, phases and steps are tensor "
                    f"bytes (their peak {format_size(ledger_peak)})")
        if self.peak_allocated:
            return (self.peak_allocated,
                    "peak: torch.mps.current_allocated_memory sampled after every op (this torch keeps no MPS peak: a "
                    f"lower bound); categories, phases and steps are tensor bytes (their peak {format_size(ledger_peak)})")
        return ledger_peak, "peak: tensor bytes (MPS reported no allocation while the profile watched)"
