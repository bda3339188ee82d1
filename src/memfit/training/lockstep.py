"""Out-of-memory errors survived by every rank together.

A data-parallel step is a sequence of collectives that every rank must issue in the same order:
FSDP2 all-gathers each unit's parameters in forward (and again in backward) and reduce-scatters its
gradients; a rank that stops half-way leaves the others waiting in a collective it never joins. So a
rank that runs out of memory does not just give up its micro-batch:

1. **It finishes the collectives.** Every collective FSDP2 issues goes through counting comms
   (``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``, FSDP2's own extension
   points), which record each one's kind, shapes and dtypes on clean micro-batches. The rank that ran
   out issues the rest of the micro-batch's sequence with zero-filled buffers of the recorded shapes,
   so its peers' collectives complete (their results that round are garbage, and dropped).
2. **Everyone agrees.** Each micro-batch ends with one all-reduce of "did anyone run out" (1 int).
   If any rank did, every rank drops its gradients, resets FSDP2's per-iteration state
   (``FSDPModule.reset_iter_state``, the recovery torch provides for an aborted forward or backward)
   and the trainer redoes the whole global batch with smaller micro-batches on every rank.
3. **DDP** issues no collective in forward here (``broadcast_buffers=False``) and its reducer's
   bucket all-reduces are deferred by a comm hook until the micro-batch's agreement: the hook hands
   the bucket back unreduced, and after a clean agreement each bucket is all-reduced and copied to the
   gradients (what DDP's default hook does, later: communication no longer overlaps backward). A rank
   whose backward was cut resets its reducer (``reducer._reset_state``, what DDP's own
   ``_update_process_group`` calls).

A template exists once a micro-batch of that kind (gradient sync on or off) ran clean; ``warm_up``
runs one tiny micro-batch of each kind at the start, weighted zero, so the first real micro-batch
can fail too. The optimizer step issues no collective (each rank steps its own shards); an
out-of-memory error inside it is rolled back and retried locally (``SafeStep``), and only "gave up"
is agreed.

Why by hand: torch has the pieces (custom comms, ``reset_iter_state``, comm hooks) but no trainer
that survives an out-of-memory error on one rank: torchtitan, torchtune, Accelerate and Lightning all
crash the job.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

__all__ = ["Lockstep", "PeerOutOfMemory", "split_by_tokens", "even_micro_batches", "HOPELESS"]

CLEAN, OUT_OF_MEMORY, HOPELESS = 0, 1, 2  # what a rank says in the agreement (the highest wins)


class PeerOutOfMemory(torch.OutOfMemoryError):
    """Another rank ran out of memory in this micro-batch: this rank redoes the global batch too."""


def split_by_tokens(ids: list[int], lengths, world: int) -> list[list[int]]:
    """The global batch ``ids`` dealt to ``world`` ranks by tokens: longest first, each to the rank
    with the fewest tokens so far (ties: the lower rank). Deterministic, so every rank computes every
    rank's share without a collective; every example is on exactly one rank."""
    shares: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for i in sorted(ids, key=lambda i: (-int(lengths[i]), i)):
        r = min(range(world), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += int(lengths[i])
    return shares


def even_micro_batches(groups: list[list], count: int) -> list[list]:
    """``groups`` (micro-batches, each a list of rows) cut into exactly ``count`` micro-batches: the
    one with the most rows halved until there are enough; ``None`` stands for a micro-batch this rank
    has no row for (run on a borrowed row, weighted zero), so every rank runs as many forwards and
    backwards, and so as many collectives, as the others."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        most = max(range(len(groups)), key=lambda k: len(groups[k]), default=None)
        if most is None or len(groups[most]) < 2:
            groups.extend([None] * (count - len(groups)))
            break
        half = len(groups[most]) // 2
        groups[most:most + 1] = [groups[most][:half], groups[most][half:]]
    return groups


@dataclass
class _Call:
    kind: str  # all_gather | reduce_scatter
    out: tuple
    inp: tuple
    dtype: torch.dtype
    group: object
    op: object = None


class Lockstep:
    """The collectives of one rank's step, counted and agreed; see the module docstring."""

    def __init__(self, model, recipe, device: torch.device):
        import torch.distributed as dist

        self.model, self.device = model, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.kind = recipe.parallel
        self.sync_every = recipe.sync_grads == "every"
        self.templates: dict[bool, list[_Call]] = {}
        self.calls: list[_Call] = []
        self.sync = True
        self.failed_at: tuple | None = None
        self.verdict = CLEAN  # the last agreement's outcome
        self.pending: list = []  # DDP buckets awaiting the agreement
        self.place = None  # the trainer's virtual budget: told where the agreement runs
        if self.kind == "fsdp":
            self._count_fsdp()
        elif self.kind == "ddp":
            model.register_comm_hook(self, _defer)

    # -- FSDP2: counted comms ---------------------------------------------------------------------
    def _count_fsdp(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(_CountedAllGather(self))
                module.set_custom_reduce_scatter(_CountedReduceScatter(self))

    def _record(self, call: _Call) -> None:
        self.calls.append(call)

    # -- one micro-batch ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def micro(self, number: int, last: bool):
        """Around one micro-batch's forward and backward: sets gradient sync (on the last micro-batch,
        or on each with ``sync_grads=every``), counts its collectives, and ends with the agreement.
        An out-of-memory error inside is re-raised for the trainer, which frees memory and calls
        :meth:`recover`; a peer's raises :class:`PeerOutOfMemory` here."""
        self.sync = last or self.sync_every
        if self.kind == "fsdp":
            self.model.set_requires_gradient_sync(self.sync)
        elif self.kind == "ddp":
            self.model.require_backward_grad_sync = self.sync
        self.calls, self.failed_at = [], None
        try:
            yield
        except torch.OutOfMemoryError:
            self.failed_at = (self.sync, len(self.calls))
            raise
        self.templates[self.sync] = self.calls
        self.verdict = self.agree(CLEAN)
        if self.verdict:
            self.pending.clear()
            raise PeerOutOfMemory(f"rank {self.rank}: another rank ran out of memory in micro-batch {number}")
        if self.pending:
            self._reduce_pending()

    def recover(self, hopeless: bool = False) -> None:
        """After this rank's own out-of-memory error (memory freed by the caller): issue the rest of
        the micro-batch's collectives, reset FSDP2's or DDP's per-iteration state, and tell the peers
        (the agreement they are waiting in); ``hopeless``: this rank cannot cut its micro-batches
        smaller, so every rank stops."""
        from memfit.errors import MemfitError

        if self.failed_at is None:
            raise MemfitError("out of memory outside a micro-batch's forward and backward, where the other ranks "
                              "cannot be told: raise the budget (rerun the command to resume)")
        sync, issued = self.failed_at
        template = self.templates.get(sync)
        if template is None:
            raise MemfitError("out of memory before any micro-batch ran clean on this rank, so its peers' "
                              "collectives cannot be completed: raise the budget")
        for call in template[issued:]:
            _replay(call, self.device)
        self.pending.clear()
        self.reset()
        self.verdict = self.agree(HOPELESS if hopeless else OUT_OF_MEMORY)
        self.failed_at = None

    def reset(self) -> None:
        """Drop what an aborted or abandoned micro-batch left in FSDP2 or DDP (gradients included)."""
        if self.kind == "fsdp":
            self.model.reset_iter_state()
            _drop_unreduced(self.model)
        elif self.kind == "ddp":
            self.model.reducer._reset_state()

    def agree(self, failed: int, what: str = "oom") -> int:
        """One all-reduce: the highest of every rank's ``failed`` (0: all clean)."""
        import torch.distributed as dist

        if self.place is not None:
            self.place(what)
        flag = torch.tensor([int(failed)], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def _reduce_pending(self) -> None:
        import torch.distributed as dist

        for buffer, grads, params in self.pending:
            dist.all_reduce(buffer)
            buffer.div_(self.world)
            for param, grad in zip(params, grads):
                if param.grad is not None:
                    param.grad.copy_(grad.view_as(param.grad))
        self.pending.clear()

    def warm_up(self, micro_batch: dict, step_fn) -> None:
        """One tiny micro-batch of each kind (sync off, then on), weighted zero, so that every kind
        has a template before the first real one; gradients dropped after. DDP takes a second synced
        one: its forward after the first synced backward rebuilds the buckets (a broadcast), which must
        not be the forward that runs out."""
        for last in (False, True) + ((True,) if self.kind == "ddp" else ()):
            with self.micro(0, last):
                loss = step_fn.loss_fn(step_fn.model, micro_batch) * 0.0
                loss.backward()
        step_fn.opt.zero_grad(set_to_none=True)
        if self.kind == "fsdp":
            self.reset()


def _drop_unreduced(model) -> None:
    """The gradients FSDP2 accumulates unsharded between reductions (``set_requires_gradient_sync
    (False)``): ``reset_iter_state`` leaves them on each parameter's unsharded tensor (torch 2.13), and
    a redone batch would add its gradients to the abandoned ones."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for param in group.fsdp_params:
                param.unsharded_accumulated_grad = None
                unsharded = getattr(param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None


def _defer(state: Lockstep, bucket):
    """DDP comm hook: hand the bucket back unreduced and keep it for after the agreement."""
    buffer = bucket.buffer()
    state.pending.append((buffer, list(bucket.gradients()), list(bucket.parameters())))
    future = torch.futures.Future()
    future.set_result(buffer)
    return future


def _replay(call: _Call, device) -> None:
    import torch.distributed as dist

    out = torch.zeros(call.out, dtype=call.dtype, device=device)
    inp = torch.zeros(call.inp, dtype=call.dtype, device=device)
    if call.kind == "all_gather":
        dist.all_gather_single(out, inp, group=call.group)
    else:
        dist.reduce_scatter_single(output=out, input=inp, group=call.group, op=call.op)


def _comms():
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    return DefaultAllGather, DefaultReduceScatter


class _CountedAllGather(_comms()[0]):
    def __init__(self, lockstep: Lockstep):
        super().__init__()
        self.lockstep = lockstep

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.lockstep._record(_Call("all_gather", tuple(output_tensor.shape), tuple(input_tensor.shape),
                                    output_tensor.dtype, group))
        return super().__call__(output_tensor, input_tensor, group, async_op)


class _CountedReduceScatter(_comms()[1]):
    def __init__(self, lockstep: Lockstep):
        super().__init__()
        self.lockstep = lockstep

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.lockstep._record(_Call("reduce_scatter", tuple(output_tensor.shape), tuple(input_tensor.shape),
                                    output_tensor.dtype, group, op))
        return super().__call__(output_tensor, input_tensor, group, op, async_op)
