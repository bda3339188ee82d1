"""The truth a generation estimate is graded against: the same ``generate``, run for real on the CPU.

``run_generate`` (``run.py``) on real tensors, nobody watching, under ``torch.profiler`` with
``profile_memory=True`` (the CPU allocator's own events, as ``estimator.truth.allocator_peak`` reads
them), plus what is resident before it starts: the weights, buffers and quantisation scales, and the
prompt. Shares nothing with the ledger.

One addition: the profiler drops the free of a block allocated before it started ("Memory block of
unknown size was allocated before the profiling started"), and a generation can free resident weights:
bitsandbytes repacks a 4-bit weight for the CPU's AVX512-BF16 kernel in its first eval forward and
drops the old one. So each resident storage carries a finalizer that, when the storage dies, opens a
profiler event named ``memfit_free_<bytes>``: a free of that many bytes at that moment.
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

from memfit.accounting.allocator_events import span
from memfit.generation.run import Request, prompt_batch, run_generate, vocab_size
from memfit.generation.weights import DTYPES, quantize_weights, stored
from memfit.scoped import quiet_profiler
from memfit.techniques.step import batch_tensors

__all__ = ["true_peak_generate", "resident_peak"]

_FREE = "memfit_free_"


def true_peak_generate(factory, request: Request, *, precision: str = "bf16", weights: str = "auto") -> int:
    """Peak bytes of ``factory()``'s real ``generate`` of ``request`` as the CPU allocator saw it, plus the
    resident model and prompt. ``factory`` builds the model (random weights: memory does not depend on
    them, but an int8 layer's outlier columns do, see ``weights.py``)."""
    torch.manual_seed(0)
    model = factory()
    dtype = DTYPES[precision]
    model.to(dtype)
    extra = quantize_weights(model, weights, dtype)
    prompt = prompt_batch(request, vocab_size(model.config))
    resident = list(model.parameters()) + list(model.buffers()) + batch_tensors(prompt) + list(extra)
    return resident_peak(lambda: run_generate(model, prompt, request), resident)


def resident_peak(fn, resident) -> int:
    """Bytes of the distinct storages of ``resident`` plus the highest bytes allocated above them while
    ``fn()`` runs on CPU, frees of resident storages included (see the module)."""
    storages = {}
    for tensor in (local for t in resident for local in stored(t)):  # a tensor subclass: its inner tensors
        storage = tensor.untyped_storage()
        storages.setdefault(storage.data_ptr(), storage)
    base = sum(s.nbytes() for s in storages.values())
    finalizers = [weakref.finalize(s, _mark_free, s.nbytes()) for s in storages.values()]
    del storages, resident
    gc.collect()
    try:
        with quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    finally:
        for finalizer in finalizers:
            finalizer.detach()
    return base + span(_sizes(prof.profiler.kineto_results.experimental_event_tree()))[0]


def _mark_free(nbytes: int) -> None:
    with record_function(f"{_FREE}{nbytes}"):
        pass


def _sizes(events) -> list[int]:
    """Signed sizes of every allocation and free under ``events``, resident frees included, in time order."""
    found = []
    todo = list(events)
    while todo:
        node = todo.pop()
        if node.tag == _EventType.Allocation:
            found.append((node.start_time_ns, node.extra_fields.alloc_size))
        elif node.name.startswith(_FREE):
            found.append((node.start_time_ns, -int(node.name[len(_FREE):])))
        todo.extend(node.children)
    return [size for _, size in sorted(found, key=lambda item: item[0])]
