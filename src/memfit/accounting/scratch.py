"""Kernel scratch, measured by the CPU allocator itself.

Some CPU kernels allocate memory the dispatcher never sees: oneDNN convolutions reorder inputs
and weights (a 3x3 conv with a 2 MiB output peaked at 4.2 MiB inside ``mkldnn_convolution``),
oneDNN RNN layers keep workspaces, low-precision matmuls reorder operands, and mixed-dtype
elementwise ops cast one input to a temporary. Scratch depends on the op, the shapes, the strides
and the dtypes, and on the oneDNN build, so no table written by hand stays right.

So each distinct call is replayed once on real tensors of the same layout (random values) under
``torch.profiler`` with ``profile_memory=True``, and the allocator's own events inside the op give
``scratch = peak inside the op - bytes still held when it returns``. Calls whose operands exceed
``PROBE_LIMIT`` bytes, matmuls over ``FLOP_LIMIT``, and calls that cannot be rebuilt from their
fake twin are not replayed:
the report counts them as unmodelled.

All probes of a trace share one profiler session (starting one costs ~60 ms).
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._pytree import tree_unflatten

from memfit.accounting.allocator_events import allocation_sizes, span
from memfit.accounting.probes import MATMULS
from memfit.hardware.cpu_kernels import probe_operands
from memfit.scoped import quiet_profiler

__all__ = ["measure_scratch", "PROBE_LIMIT", "FLOP_LIMIT"]

#: Operands larger than this are not replayed (bytes of real memory a probe may take).
PROBE_LIMIT = 256 * 1024**2
#: Matmuls costlier than this are not replayed (~20 ms of 2 cores); their scratch was seen to be
#: under 10% of their output, and an 8B model in bf16 would otherwise spend minutes probing.
FLOP_LIMIT = 2 * 10**9

_TAG = "memfit_probe_"


def measure_scratch(ledger) -> tuple[list[int], int]:
    """Scratch bytes of each of ``ledger.sites``, and how many distinct calls went unprobed.

    Replaying a call also shows what its real outputs hold. Where a fake kernel's output differs
    from the real one (the oneDNN LSTM workspace is empty on fake tensors; CPU batch-norm keeps
    fp32 statistics for bf16 inputs), the ledger's record takes the real size, and later calls
    that read that output are rebuilt with its real layout.
    """
    sites, records = ledger.sites, ledger.records
    scratch = [0] * len(sites)
    if not sites:
        return scratch, 0
    real_meta: dict[int, tuple] = {}  # record index -> (fake layout, real layout) where they differ
    results: dict[tuple, tuple | None] = {}
    order, site_keys = [], []
    with _outside_modes(), quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for site in sites:
            layout = _real_layout(site, real_meta)
            key = (site.key, tuple(m for kind, m in layout if kind == "tensor"))
            site_keys.append(key)
            if key not in results:
                results[key] = _probe(len(order), site, layout)
                order.append(key)
            outcome = results[key]
            if outcome is not None:
                for record, fake, meta in zip(site.out_records, site.out_metas, outcome):
                    if record is not None and meta is not None and meta[:3] != fake[:3]:
                        real_meta[record] = (fake, meta[:4])
                        records[record].nbytes = meta[4]
    spans = _allocation_spans(prof)
    number = {key: i for i, key in enumerate(order)}
    for index, key in enumerate(site_keys):
        if results[key] is not None:
            peak, final = spans.get(number[key], (0, 0))
            scratch[index] = max(0, peak - final)
    unprobed = sum(1 for outcome in results.values() if outcome is None)
    return scratch, unprobed


def _real_layout(site, real_meta) -> list:
    """The site's operands, with the real layout of any operand a probe corrected."""
    layout, records = [], iter(site.arg_records)
    for kind, meta in site.spec[2]:
        if kind == "tensor":
            record = next(records)
            fake, real = real_meta.get(record, (None, None))
            if fake is not None and fake[:3] == meta[:3]:  # the very output, not a view of it
                meta = real
        layout.append((kind, meta))
    return layout


def _probe(number: int, site, layout):
    """Replay one call; the real outputs' (shape, stride, dtype, grad, nbytes), or None."""
    if _operand_bytes(layout) > PROBE_LIMIT or _flops(site.key[0], layout) > FLOP_LIMIT or _unsafe(layout):
        return None
    func, tree, _ = site.spec
    leaves = [_real(meta) if kind == "tensor" else meta for kind, meta in layout]
    args, kwargs = probe_operands(func, *tree_unflatten(leaves, tree))  # MoE group offsets: cpu_kernels.py
    try:
        with torch.set_grad_enabled(site.key[2]), record_function(f"{_TAG}{number}"):
            out = func(*args, **kwargs)
    except (RuntimeError, ValueError, TypeError, IndexError):
        return None  # the call as rebuilt is invalid; its scratch stays unknown
    flat = out if isinstance(out, (tuple, list)) else (out,)
    return [(tuple(t.shape), tuple(t.stride()), t.dtype, False, t.untyped_storage().nbytes())
            if isinstance(t, torch.Tensor) else None for t in flat]


def _unsafe(layout) -> bool:
    # An empty byte buffer stands for a workspace the fake kernel did not size; a real kernel
    # would read past its end, so such calls are never replayed as they are.
    return any(kind == "tensor" and meta[2] == torch.uint8 and 0 in meta[0] for kind, meta in layout)


def _flops(func, layout) -> int:
    """Multiply-adds x 2 of a matmul-family call (0 for other ops)."""
    if func.__name__.split(".")[0] not in MATMULS:
        return 0
    mats = [meta[0] for kind, meta in layout if kind == "tensor" and len(meta[0]) >= 2]
    if len(mats) < 2:
        return 0
    (a, b) = mats[:2]
    return 2 * math.prod(a) * b[-1]


def _operand_bytes(layout) -> int:
    total = 0
    for kind, meta in layout:
        if kind == "tensor":
            shape, stride, dtype, _grad = meta
            extent = 1 + sum((s - 1) * st for s, st in zip(shape, stride)) if all(shape) else 0
            total += extent * torch.empty((), dtype=dtype).element_size()
    return total


def _real(meta) -> torch.Tensor:
    shape, stride, dtype, _grad = meta
    tensor = torch.empty_strided(shape, stride, dtype=dtype)
    # Values do not change what a kernel allocates, only that they are finite; a constant fill
    # is ~50x faster than random numbers on large operands.
    return tensor.fill_(0.5 if (dtype.is_floating_point or dtype.is_complex) else 0)


def _allocation_spans(prof) -> dict[int, tuple[int, int]]:
    """For each probe marker: (highest running sum, final sum) of allocations inside it."""
    spans = {}

    def visit(event):
        if event.name.startswith(_TAG):
            spans[int(event.name[len(_TAG):])] = span(allocation_sizes(event))
            return
        for child in event.children:
            visit(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        visit(root)
    return spans


@contextlib.contextmanager
def _outside_modes():
    """Leave any fake / dispatch modes so the probe runs on real memory."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes

    with unset_fake_temporarily(), _disable_current_modes():
        yield
