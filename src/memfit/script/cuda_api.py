"""What ``torch.cuda`` (and ``torch.accelerator``) answer to a script while its ``cuda`` is a modelled card.

Available, ``gpus`` devices of the card's name, memory, compute capability and bf16 support;
``set_device`` / ``current_device``; streams and events that do nothing (the fake step has no concurrency to
order); and the memory counters — ``memory_allocated``, ``max_memory_allocated``, ``memory_reserved``,
``max_memory_reserved``, ``memory_stats``, ``mem_get_info``, ``reset_peak_memory_stats`` — from memfit's
caching allocator (``accounting/cuda_allocator.py``) fed the card's events so far (``Counters``), so a script
that prints its own peak prints memfit's prediction of it. ``set_per_process_memory_fraction`` is kept: the
verdict is then the fraction's (``estimate.py``). ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` in the
environment gives the counters expandable segments, as torch reads it.

Left out: CUDA graphs, ``torch.cuda.nvtx``, IPC, the RNG state of the card (seeds are accepted and ignored, a
state read is zeros),
and each device's own counters (``cuda:1`` answers as ``cuda:0``: a script runs as one rank).
"""

from __future__ import annotations

import contextlib
import os
import types

import torch

from memfit.accounting.events import ALLOC, FREE, RENAME, storage_events
from memfit.scoped import patched

__all__ = ["CudaApi", "Counters", "Stream"]


class Counters:
    """The card's allocator after the events ``ledger`` recorded so far; each call replays only the new ones."""

    def __init__(self, card_side):
        self.card_side = card_side  # record -> True when it is the card's
        self.ledger = None
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        from memfit.accounting.cuda_allocator import CachingAllocator

        self.allocator = CachingAllocator(expandable_segments="expandable_segments:true" in conf.replace(" ", "").lower())
        self._handles: dict[int, int] = {}
        self._seen = 0
        self.peak_allocated = self.peak_reserved = 0

    def stats(self):
        """The allocator's statistics now; ``peak_allocated`` / ``peak_reserved`` since the last ``reset``."""
        ledger = self.ledger
        if ledger is None:
            return self.allocator.stats
        events = ledger.events[self._seen:]
        self._seen = len(ledger.events)
        records, handles, allocator = ledger.records, self._handles, self.allocator
        view = types.SimpleNamespace(records=records, events=events)
        for kind, index in storage_events(view):
            if kind == ALLOC and self.card_side(records[index]):
                handles[index] = allocator.malloc(records[index].nbytes, stream=records[index].stream)
            elif kind == RENAME and records[index].donor in handles:
                handles[index] = handles.pop(records[index].donor)
            elif kind == FREE and index in handles:
                allocator.free(handles.pop(index))
            else:
                continue
            stats = allocator.stats
            self.peak_allocated = max(self.peak_allocated, stats.allocated)
            self.peak_reserved = max(self.peak_reserved, stats.reserved)
        return allocator.stats

    def reset(self) -> None:
        stats = self.stats()
        self.peak_allocated, self.peak_reserved = stats.allocated, stats.reserved


class _Properties(types.SimpleNamespace):
    def __repr__(self) -> str:
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory // 2**20}MB, multi_processor_count={self.multi_processor_count})")


class Stream:
    """A CUDA stream or event that does nothing."""

    def __init__(self, *args, **kwargs):
        self.device = torch.device("cuda", 0)
        self.cuda_stream = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "record_event":  # an event the caller waits on (torchao's CPUOffloadOptimizer synchronizes it)
            return lambda *a, **k: Stream()
        return lambda *a, **k: (True if name == "query" else False if name == "is_capturing"
                                else 0.0 if name == "elapsed_time" else None)


def _rng_state(device=None):
    """A generator state to save and give back (dynamo saves it around a graph, checkpointing per region): on a
    real card 16 bytes of host memory (Philox seed and offset), here zeros."""
    with torch.utils._python_dispatch._disable_current_modes():
        return torch.zeros(16, dtype=torch.uint8)


class CudaApi:
    """While active, ``torch.cuda`` and ``torch.accelerator`` answer as ``gpus`` of ``card``; ``counters`` must be
    given the ledger before the script allocates."""

    def __init__(self, card, gpus: int, counters: Counters):
        self.card, self.gpus, self.counters = card, gpus, counters
        self.current = 0
        self.fraction = None  # what the script passed to set_per_process_memory_fraction
        self._scope = None

    def __enter__(self) -> "CudaApi":
        with contextlib.ExitStack() as scope:
            for name, value in self._cuda().items():
                scope.enter_context(patched(torch.cuda, name, value))
            scope.enter_context(patched(torch.cuda.memory, "mem_get_info", self._mem_get_info))
            if hasattr(torch, "accelerator"):  # accelerate and the optimizers ask it
                for name, value in self._accelerator().items():
                    scope.enter_context(patched(torch.accelerator, name, value))
            self._scope = scope.pop_all()
        return self

    def __exit__(self, *exc):
        self._scope.close()
        return False

    def set_device(self, device) -> None:
        index = device.index if isinstance(device, torch.device) else (
            int(device.split(":")[1]) if isinstance(device, str) and ":" in device else device)
        self.current = int(index or 0)

    def _properties(self, device=None):
        card = self.card
        major, minor = card.compute_capability
        return _Properties(name=card.full_name, major=major, minor=minor, total_memory=card.memory_bytes,
                           multi_processor_count=132, is_integrated=False, is_multi_gpu_board=False,
                           L2_cache_size=50 * 2**20, uuid="memfit-" + card.name, gcnArchName="")

    def _mem_get_info(self, device=None):
        total = self.card.memory_bytes
        return max(total - self.card.outside_bytes - self.counters.stats().reserved, 0), total

    def _memory_stats(self, device=None) -> dict:
        counters = self.counters
        stats = counters.stats()
        out = {}
        for prefix, now, peak in (("allocated_bytes", stats.allocated, counters.peak_allocated),
                                  ("reserved_bytes", stats.reserved, counters.peak_reserved),
                                  ("active_bytes", stats.allocated, counters.peak_allocated),
                                  ("requested_bytes", stats.requested, stats.peak_requested)):
            out.update({f"{prefix}.all.current": now, f"{prefix}.all.peak": peak})
        out.update({"num_alloc_retries": stats.num_alloc_retries, "num_ooms": stats.num_ooms,
                    "segment.all.current": stats.segments, "num_device_alloc": stats.num_device_alloc})
        return out

    def _counters(self) -> dict:
        counters = self.counters

        def peak_allocated(*a, **k):
            counters.stats()
            return counters.peak_allocated

        def peak_reserved(*a, **k):
            counters.stats()
            return counters.peak_reserved

        return {"memory_allocated": lambda *a, **k: counters.stats().allocated,
                "max_memory_allocated": peak_allocated,
                "memory_reserved": lambda *a, **k: counters.stats().reserved,
                "max_memory_reserved": peak_reserved,
                "reset_peak_memory_stats": lambda *a, **k: counters.reset(),
                "memory_stats": self._memory_stats, "empty_cache": lambda *a, **k: None}

    def _accelerator(self) -> dict:
        return dict(self._counters(), **{
            "is_available": lambda *a, **k: True, "current_accelerator": lambda *a, **k: torch.device("cuda"),
            "device_count": lambda: self.gpus, "current_device_index": lambda: self.current,
            "current_device_idx": lambda: self.current, "set_device_index": self.set_device,
            "set_device_idx": self.set_device, "synchronize": lambda *a, **k: None,
            "current_stream": lambda *a, **k: Stream(), "set_stream": lambda *a, **k: None})

    def _cuda(self) -> dict:
        card = self.card
        nothing = lambda *a, **k: None  # noqa: E731
        stream = lambda *a, **k: Stream()  # noqa: E731
        return dict(self._counters(), **{
            "is_available": lambda: True, "device_count": lambda: self.gpus, "is_initialized": lambda: True,
            "init": nothing, "_lazy_init": nothing, "synchronize": nothing, "ipc_collect": nothing,
            "get_device_properties": self._properties, "get_device_name": lambda device=None: card.full_name,
            "get_device_capability": lambda device=None: tuple(card.compute_capability),
            "is_bf16_supported": lambda including_emulation=True: bool(card.bf16),
            "set_device": self.set_device, "current_device": lambda: self.current,
            "Stream": Stream, "Event": Stream, "stream": lambda s=None: contextlib.nullcontext(),
            "current_stream": stream, "default_stream": stream,
            "manual_seed": nothing, "manual_seed_all": nothing, "seed": nothing, "seed_all": nothing,
            "initial_seed": lambda: 0, "get_rng_state": _rng_state, "set_rng_state": nothing,
            "get_rng_state_all": lambda: [_rng_state() for _ in range(self.gpus)], "set_rng_state_all": nothing,
            "mem_get_info": self._mem_get_info,
            "reset_max_memory_allocated": lambda *a, **k: self.counters.reset(),
            "set_per_process_memory_fraction": lambda fraction, device=None: setattr(self, "fraction", fraction),
            # torch 2.11's optimizers ask it before each step (later ones ask torch.accelerator's stream); a CUDA
            # build of torch with no device visible would raise "no CUDA-capable device"
            "is_current_stream_capturing": lambda: False,
        })
