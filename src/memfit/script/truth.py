"""Independent truth for a script's estimate on CPU: the script run for real, the CPU allocator's own events.

The same script, the same arguments, on real CPU tensors under ``torch.profiler`` with ``profile_memory``
(``estimator/truth.allocator_peak``), stopped after the same number of optimizer steps by torch's global
optimizer step hook. It shares nothing with the ledger, the fake tensors or the device shim: what the tests
and ``bench/accuracy/scripts.py`` grade ``estimate_script(..., device="cpu")`` against.

``card_peak`` runs it on a real GPU and reads torch's own counters (``bench/gpu/scripts_gpu.py``). ``ranks_peak`` runs it under ``torchrun --nproc-per-node N`` over gloo (``python -m memfit.script.truth``: each
rank writes its peak), counting the allocations of each rank's main thread (``distributed/truth.main_thread``:
gloo's worker threads' staging copies are left out, as NCCL's buffers are outside the caching allocator).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from torch.optim.optimizer import register_optimizer_step_post_hook

from memfit.estimator.truth import allocator_peak
from memfit.script.device import cuda_hidden, forget_devices
from memfit.script.runner import run, target as make_target

__all__ = ["script_peak", "card_peak", "ranks_peak", "main"]


class _Stop(BaseException):
    pass


def _stopping(what, steps: int, cuda: bool = False):
    """A function that runs ``what`` on the CPU (``cuda``: as it is, on the GPU torch sees), stopped after ``steps``
    optimizer steps; ``seen[0]``: steps run."""
    seen = [0]

    def counted(optimizer, args, kwargs):
        seen[0] += 1
        if steps and seen[0] >= steps:
            raise _Stop

    def body():
        forget_devices()
        handle = register_optimizer_step_post_hook(counted)
        try:
            with cuda_hidden() if not cuda else contextlib.nullcontext():
                run(what)
        except _Stop:
            pass
        finally:
            handle.remove()
            forget_devices()

    return body, seen


def script_peak(path, argv=(), *, module: bool = False, steps: int = 2) -> tuple[int, int]:
    """(the highest bytes the CPU allocator held above its level at the start, optimizer steps run) while the
    script runs for real on the CPU (``torch.cuda.is_available()`` answers False, as on a CPU-only machine),
    stopped after ``steps`` optimizer steps (0: to its end)."""
    body, seen = _stopping(make_target(path, argv, module=module), steps)
    return allocator_peak(body), seen[0]


def card_peak(path, argv=(), *, module: bool = False, steps: int = 2) -> dict:
    """On a machine with a GPU: the script run on it, stopped after ``steps`` optimizer steps; torch's own
    ``max_memory_allocated`` and ``max_memory_reserved`` since the start (``bench/gpu/scripts_gpu.py``)."""
    import torch

    body, seen = _stopping(make_target(path, argv, module=module), steps, cuda=True)
    torch.cuda.reset_peak_memory_stats()
    body()
    torch.cuda.synchronize()
    return {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved(),
            "steps": seen[0]}


def ranks_peak(path, argv=(), *, nproc: int = 2, module: bool = False, steps: int = 2,
               timeout: float = 600) -> list[dict]:
    """Each rank's ``{"rank", "peak_bytes", "steps"}`` of the script under ``torchrun --nproc-per-node nproc``."""
    what = make_target(path, argv, module=module)
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                   "-m", "memfit.script.truth", "--out", out, "--steps", str(steps),
                   *(["-m"] if module else []), *what.argv]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        if done.returncode:
            raise RuntimeError(f"torchrun failed ({done.returncode}):\n{done.stderr[-4000:]}")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(nproc)]


def _rank_run(what, steps: int) -> dict:
    import gc

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from memfit.distributed.truth import allocation_events, main_thread, settle_collectives
    from memfit.scoped import quiet_profiler

    torch.set_num_threads(1)
    settle_collectives()
    body, seen = _stopping(what, steps)
    gc.collect()
    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("memfit::steps"):
            pass
        body()
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    if dist.is_initialized():
        dist.destroy_process_group()
    events, marks = allocation_events(prof)
    thread = marks["memfit::steps"][0][1]
    live = peak = 0
    for _, nbytes in main_thread(events, thread):
        live += nbytes
        peak = max(peak, live)

    return {"rank": rank, "peak_bytes": peak, "steps": seen[0]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="one torchrun rank of a script, graded by the CPU allocator")
    parser.add_argument("--out", required=True, help="folder for rank<r>.json")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("-m", dest="module", action="store_true")
    parser.add_argument("target", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    what = make_target(args.target[0], args.target[1:], module=args.module)
    result = _rank_run(what, args.steps)
    Path(args.out, f"rank{result['rank']}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
