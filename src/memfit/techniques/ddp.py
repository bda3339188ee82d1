"""DDP (``DistributedDataParallel``) for ``parallel=ddp``: the model replicated over the whole world, and made to
run on fake tensors and PyTorch's fake process group (``on_fake_group``, which a user's script's DDP goes through
too).

Every rank holds the whole model and its optimizer state, plus the reducer's gradient buckets (one copy of the
trainable parameters). On fake tensors the start-up broadcast and the per-forward buffer broadcast are off (they
read data pointers), a comm hook hands the reducer its bucket back, and the reducer's bucket rebuild is left out
(the same bytes). Left out: FSDP2 (``fsdp.py``) and the technique's fields and conflicts (``parallel.py``).
"""

from __future__ import annotations

import warnings

__all__ = ["replicate", "on_fake_group"]


def replicate(build, place) -> None:
    """``build``'s model wrapped in DDP over the whole world (the default group, across nodes too)."""
    from torch.nn.parallel import DistributedDataParallel

    if not place.fake:
        # torch's defaults, as a plain script has them (the start-up broadcast is construction)
        build.model = DistributedDataParallel(build.model, init_sync=place.init_sync,
                                              broadcast_buffers=place.broadcast_buffers)
        return
    # On fake tensors DDP's start-up broadcast and per-forward buffer broadcast read data pointers:
    # both are off here (a coalesced copy of the buffers per forward, small beside a step, goes unseen).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # broadcast_buffers' rename
        build.model = DistributedDataParallel(build.model, broadcast_buffers=False, init_sync=False)
    on_fake_group(build.model, build.watch)


def on_fake_group(ddp, watch) -> None:
    """``ddp`` (a DDP made with ``init_sync=False`` and ``broadcast_buffers=False`` on fake tensors and the fake
    process group) made to run there: the fake group's all-reduce completes with no value, so a comm hook gives
    DDP's reducer its bucket back (marked ``communication`` in ``watch``), and the reducer's bucket rebuild, which
    reads a data pointer, is left out (``_NoRebuild``). A user's script's DDP goes through it too
    (``script/ranks.py``)."""
    ddp.register_comm_hook(watch, _bucket_back)
    ddp.reducer = _NoRebuild(ddp.reducer)


class _NoRebuild:
    """DDP's reducer, less the bucket rebuild at the second step's forward: the rebuild reads a
    gradient's data pointer, which a fake tensor has not. It frees the old buckets before making
    the new ones (``Reducer::initialize_buckets``), the same bytes in the order gradients became
    ready, so the memory of the step does not change."""

    def __init__(self, reducer):
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._reducer, name)


def _bucket_back(watch, bucket):
    """A DDP comm hook for the fake process group: the bucket reduced in place, as the built-in
    all-reduce hook leaves it (no memory of its own); labels the bucket."""
    import torch

    from memfit.categories import Category

    watch.mark(bucket.buffer(), Category.COMMUNICATION)
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future
