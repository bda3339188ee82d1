"""The ranks of a data-parallel training run: the process group, each rank's share of a global batch,
loss weights over the whole world, and the per-rank figures rank 0 logs.

``join`` uses the process group the caller initialised (torchrun, Slurm, Accelerate), or initialises
one from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``): NCCL on CUDA, gloo on
the CPU. A global batch is dealt to ranks by tokens (``lockstep.split_by_tokens``); each rank cuts its
share into micro-batches as one process would, and every rank runs as many micro-batches as the rank
that needs the most (``lockstep.even_micro_batches``), so the collectives of every micro-batch line up.
The order of global batches does not depend on the world size, so a checkpoint resumes at any.

Loss weights: a micro-batch's loss (a mean over its label tokens) is weighted by
``world x its label tokens / the global batch's label tokens``; FSDP2 and DDP average gradients over
ranks, so the update is the one-process update of the same global batch (to summation order).
"""

from __future__ import annotations

import os

import torch

from memfit.errors import MemfitError

__all__ = ["Ranks", "join", "under_torchrun"]


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or another launcher setting its variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def join(device: torch.device) -> Ranks | None:
    """This process's ranks: the initialised process group, or one initialised from torchrun's
    environment; None for a process on its own."""
    import torch.distributed as dist

    if not dist.is_available():
        return None
    created = False
    if not dist.is_initialized():
        if not under_torchrun():
            return None
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # torchrun's store outlives a restart, and gloo would read the dead processes' addresses from
        # it (seen: every restart after a kill -9 refused): each attempt's keys under its own prefix
        store, rank, world = next(dist.rendezvous("env://"))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend, store=dist.PrefixStore(f"memfit/attempt-{attempt}", store), rank=rank,
                                world_size=world)
        created = True
    backend = dist.get_backend()
    if device.type == "cuda" and backend != "nccl" or device.type == "cpu" and backend not in ("gloo", "cpu:gloo,cuda:nccl"):
        raise MemfitError(f"the process group's backend {backend} does not move {device.type} tensors: "
                          f"initialise it with {'nccl' if device.type == 'cuda' else 'gloo'}")
    return Ranks(dist.get_rank(), dist.get_world_size(), device, created)


class Ranks:
    """One rank of the run; see the module docstring."""

    def __init__(self, rank: int, world: int, device: torch.device, created: bool):
        self.rank, self.world, self.device, self.created = rank, world, device, created
        self.lockstep = None  # set once the model is wrapped

    def all_sum(self, value: float) -> float:
        import torch.distributed as dist

        tensor = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return float(tensor.item())

    def weights(self, counts: list, dummies: list[bool]) -> list:
        """Each micro-batch's loss weight over the whole world (``counts``: label tokens per micro-batch)."""
        local = sum(0 if dummy else int(c) for c, dummy in zip(counts, dummies))
        total = self.all_sum(local)
        if total <= 0:
            raise MemfitError("the global batch has no label tokens: every example is one token or less")
        return [0.0 if dummy else self.world * int(c) / total for c, dummy in zip(counts, dummies)]

    def gather(self, values: list[float]) -> list[list[float]]:
        """``values`` of every rank (one all-gather), rank order."""
        import torch.distributed as dist

        mine = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        out = torch.empty(self.world * len(values), dtype=torch.float64, device=self.device)
        dist.all_gather_single(out, mine)
        return out.view(self.world, len(values)).tolist()

    def line(self, line: dict, value, now, peak, predicted, seconds, parts):
        """Fills ``line`` with every rank's figures; returns the world's loss and the slowest rank's time."""
        rows = self.gather([value, -1 if now is None else now, -1 if peak is None else peak,
                            -1 if predicted is None else predicted, seconds, parts])

        def size(x):
            return None if x < 0 else int(x)

        line["ranks"] = [{"rank": r, "memory_now": size(row[1]), "memory_peak": size(row[2]), "predicted": size(row[3]),
                          "seconds": round(row[4], 6), "micro_batches": int(row[5])} for r, row in enumerate(rows)]
        world_loss = sum(row[0] for row in rows) / self.world
        line["loss"] = world_loss
        line["rank_loss"] = value
        for key, index in (("memory_now", 1), ("memory_peak", 2), ("predicted", 3)):
            sizes = [size(row[index]) for row in rows]
            line[key] = None if None in sizes else max(sizes)
        line["micro_batches"] = int(rows[0][5])
        return world_loss, max(row[4] for row in rows)

    def same(self, value):
        """Rank 0's ``value`` on every rank (a checkpoint path, say)."""
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        import torch.distributed as dist

        if self.created and dist.is_initialized():
            # every rank done with every collective before any destroys its group (a rare abort at
            # exit, "terminate called without an active exception", is seen with and without this)
            dist.barrier()
            dist.destroy_process_group()
