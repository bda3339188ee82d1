"""Independent truth for one rank: a real data-parallel step under ``torchrun``, graded by the CPU
allocator's own events.

Run as ``torchrun --nproc_per_node N -m memfit.distributed.truth --case JSON --out DIR``; each rank
writes ``DIR/rank<r>.json`` with the highest bytes its allocator held during the steps. The model is
built for real on the host (random weights), the recipe applied by ``memfit.apply`` (FSDP2 shards it,
DDP wraps it: the same code the estimate runs on fake tensors), and the steps run on real tensors
over gloo. ``torch.profiler`` (``profile_memory``) records every allocation and free from before the
model exists, so what was live when the steps began needs no bookkeeping of memfit's own; the figure
is the highest running total during the steps. ``launch`` runs it from Python (the tests, bench/);
``launch_many`` runs several cases in one ``torchrun`` (one process start and one set of imports for all: the
tests' truths), each case on a process group of its own (its own rendezvous keys), its own profiler window and
result, with a ``gc`` between cases. A case's figures are those it has run alone: what an earlier case leaves
alive was allocated before the next one's profiler began, and its frees are not counted (``main_thread`` keeps
only the frees of what it saw allocated).

gloo, not NCCL: its collectives copy through buffers of their own on worker threads (a full-size
copy per all-gather and reduce-scatter); those threads' allocations are left out (``main_thread``
below), as NCCL's buffers are outside the caching allocator on a GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["launch", "launch_many", "main", "settle_collectives", "allocation_events", "main_thread"]


# Profiler events of a collective: allocations under them are the backend's own staging copies.
_BACKEND = ("c10d::", "gloo:", "record_param_comms")


def allocation_events(prof):
    """(start ns, signed bytes, thread, pointer) of every allocation and free, in time order; the
    thread is -1 for what a collective allocated inside its own op (gloo's staging copies)."""
    from torch._C._profiler import _EventType

    found, marks = [], {}

    def walk(node, backend=False):
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            found.append((node.start_time_ns, fields.alloc_size, -1 if backend else node.start_tid, fields.ptr))
            return
        backend = backend or node.name.startswith(_BACKEND)
        if node.name.startswith("memfit::"):
            marks.setdefault(node.name, []).append((node.start_time_ns, node.start_tid))
        for child in node.children:
            walk(child, backend)

    for event in prof.profiler.kineto_results.experimental_event_tree():
        walk(event)
    found.sort(key=lambda item: item[0])
    return found, marks


def main_thread(events, thread: int):
    """The events of ``thread``, and frees of what it allocated wherever they happened: allocations
    a backend's worker threads make for themselves (and their frees) are dropped."""
    own, kept = set(), []
    for start, size, tid, ptr in events:
        if size > 0:
            if tid != thread:
                continue
            own.add(ptr)
        elif ptr not in own:
            continue
        else:
            own.discard(ptr)
        kept.append((start, size))
    return kept


def _settled(collective):
    """``collective`` that returns only once gloo's worker thread has dropped its references to the
    tensors it was given: gloo's ``wait()`` returns while the worker still holds them (seen: a
    storage's use count 5 after ``all_gather_single`` returned, 3 a moment later), so their free came
    at a random point of the main thread's step and its peak varied run to run by a unit's size."""
    import time

    import torch

    use_count = torch._C._storage_Use_Count

    def call(*args, **kwargs):
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        tensors += [t for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple)) for t in a
                    if isinstance(t, torch.Tensor)]
        storages = [t.untyped_storage() for t in tensors]  # held through the wait: each count one higher throughout
        cdata = [s._cdata for s in storages]
        before = [use_count(c) for c in cdata]
        # gloo's worker also holds the op's at::Tensors themselves (no new storage reference) until just after it
        # marks the work done: a temporary the caller reduced and dropped at once (DeepSpeed's flattened buckets) was
        # then freed on the worker's thread, where the profiler records no free (the truth a bucket high for the rest
        # of the run: 68 to 236 KB on one rank in about 1 of 5 loaded runs). Such a hold shows in the tensor's own
        # use count where the holder is a plain at::Tensor, and in its Python object's count where it is an IValue
        # (the work's future: torch 2.13 keeps the Python object alive for it; the use count stays 1).
        held = _counts(tensors)
        # an asynchronous call (DeepSpeed's stage-3 gathers) runs to its end here: its handle holds the tensors, so
        # their counts could not settle while the caller keeps it (an estimate's collectives complete at once too)
        asynchronous = kwargs.pop("async_op", False)
        out = collective(*args, **kwargs)
        deadline = time.monotonic() + 5
        while _busy(cdata, before, tensors, held) and time.monotonic() < deadline:
            time.sleep(0)
        return _Done() if asynchronous else out

    return call


def _counts(tensors) -> list:
    """Each tensor's own use count and its Python object's reference count, as ``_busy`` reads them."""
    import sys

    found, i = [], 0
    while i < len(tensors):
        found.append(tensors[i]._use_count())
        found.append(sys.getrefcount(tensors[i]))
        i += 1
    return found


def _busy(cdata, before, tensors, held) -> bool:
    """Whether gloo's worker still holds a storage (``cdata``'s counts above ``before``) or a tensor (its counts
    above ``held``, from ``_counts``), making no object the garbage collector tracks while it looks."""
    import sys

    import torch

    use_count, i = torch._C._storage_Use_Count, 0
    while i < len(cdata):
        if use_count(cdata[i]) > before[i]:
            return True
        i += 1
    i = 0
    while i < len(tensors):
        if tensors[i]._use_count() > held[2 * i] or sys.getrefcount(tensors[i]) > held[2 * i + 1]:
            return True
        i += 1
    return False


class _Done:
    """The handle of a collective that has completed."""

    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True




def _settled_wait(wait):
    """Functional collectives' ``wait_tensor`` (DTensor's: tensor parallelism) that returns once gloo's worker
    has let go of the result: it holds a reference for a moment after the wait, as with ``_settled``, and a
    free that should come at once came at a random later point of the step."""
    import time

    import torch

    def count(tensor):
        return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)

    def call(tensor, *args, **kwargs):
        out = wait(tensor, *args, **kwargs)
        deadline, last, steady = time.monotonic() + 0.05, count(out), 0
        while steady < 3 and time.monotonic() < deadline:  # the count unchanged over three looks
            time.sleep(0.0005)
            now = count(out)
            steady, last = (steady + 1, now) if now == last else (0, now)
        return out

    return call


def _settled_functional(collective, wait):
    """A functional collective waited on at once, returning when gloo's worker holds neither its input nor its result
    (an estimate's collectives complete at once: the input is free when the caller drops it)."""
    import time

    import torch

    def count(tensor):
        return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)

    def call(tensor, *args, **kwargs):
        before = count(tensor)
        out = wait(collective(tensor, *args, **kwargs))
        deadline = time.monotonic() + 5
        while count(tensor) > before and time.monotonic() < deadline:
            time.sleep(0.0002)
        # the result's count settles at 2, not 1 (a reference beyond gloo's worker, held past any wait: the old
        # test ``count(out) > 1`` ran out its 5 s at every call, about 40 a case): unchanged over three looks
        deadline, last, steady = time.monotonic() + 0.05, count(out), 0
        while steady < 3 and time.monotonic() < deadline:
            time.sleep(0.0005)
            now = count(out)
            steady, last = (steady + 1, now) if now == last else (0, now)
        return out

    return call


def _settled_p2p(batch):
    """A pipeline schedule's point-to-point batch whose works, once waited on, return only when gloo's worker has let
    go of the tensors sent and received (as ``_settled_wait``): a stage's send held by the worker a moment after its
    wait left both TP ranks of a stage 4 KB over the estimate in one loaded run."""
    import time

    import torch

    def count(tensor):
        return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)

    class Settled:
        def __init__(self, work, tensors):
            self.work, self.tensors = work, tensors

        def wait(self, *args, **kwargs):
            out = self.work.wait(*args, **kwargs)
            deadline, steady = time.monotonic() + 0.05, 0
            last = [count(t) for t in self.tensors]
            while steady < 3 and time.monotonic() < deadline:  # every count unchanged over three looks
                time.sleep(0.0005)
                now = [count(t) for t in self.tensors]
                steady, last = (steady + 1, now) if now == last else (0, now)
            return out

        def __getattr__(self, name):
            return getattr(self.work, name)

    def call(ops, *args, **kwargs):
        tensors = [op.tensor for op in ops]
        return [Settled(work, tensors) for work in batch(ops, *args, **kwargs)]

    return call


def _phases():
    """A watch for ``apply`` that marks each phase in the profile (``memfit::forward:0``) and labels
    nothing (``Quiet``: the step runs as with nobody watching): the truth's only bookkeeping is where
    each phase begins."""
    import torch

    from memfit.techniques.apply import Quiet

    class Phases(Quiet):
        def begin(self, phase, step):
            with torch.profiler.record_function(f"memfit::{phase}:{step}"):
                pass

    return Phases()


def _bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors``."""
    seen = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


_SETTLED = []


def settle_collectives() -> None:
    """For the rest of this truth process: gloo's collectives return once its worker threads let go of their
    tensors (``_settled``), so a rank's frees happen where a plain run's do, not at random later points. Once a
    process: a second call (the next case of ``launch_many``) leaves the wrappers as they are."""
    import torch.distributed as dist

    if _SETTLED:
        return
    _SETTLED.append(True)

    for name in ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor",
                 "all_reduce", "broadcast", "reduce", "all_gather"):
        setattr(dist, name, _settled(getattr(dist, name)))
    import torch.distributed._functional_collectives as funcol

    funcol.wait_tensor = _settled_wait(funcol.wait_tensor)
    # context parallel's ring (torch's rotaters) hands these its keys and values: gloo's worker holds the input and
    # the result until it is done, so they were freed at random points (cp-2: 20 to 54 KB high, run to run)
    for name in ("all_gather_single", "all_to_all_single"):
        setattr(funcol, name, _settled_functional(getattr(funcol, name), funcol.wait_tensor))
    import torch.distributed.pipelining.schedules as schedules

    schedules._batch_p2p = _settled_p2p(schedules._batch_p2p)


def _run(case: dict, store=None) -> dict:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from memfit.hardware.cluster import real_world
    from memfit.models.source import resolve
    from memfit.scoped import quiet_profiler
    from memfit.techniques.apply import apply
    from memfit.techniques.recipe import Recipe
    from memfit.techniques.step import batch_tensors

    torch.set_num_threads(1)
    settle_collectives()
    if store is None:
        dist.init_process_group("gloo")
    else:  # one case of several: its own keys in the launch's store (rendezvous keys of a case before are stale)
        dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    rank, size = dist.get_rank(), dist.get_world_size()
    recipe = Recipe.from_dict(case.get("recipe", {}))
    source = resolve(case["model"])
    # tensor- and context-parallel peers and pipeline stages read the same rows; the data-parallel ranks split them
    from memfit.hardware.cluster import Layout, World

    gpus = case.get("gpus_per_node") or size
    layout = Layout.of_recipe(World(gpus, size // gpus), recipe)
    per_rank = case["batch_size"] // layout.rows_split
    gc.collect()
    try:
        # every rank builds the same weights (seed 0), so DDP's start-up broadcast is skipped: its
        # coalesced copy of all parameters stays with a gloo worker thread until a random later time
        with real_world(case.get("gpus_per_node"), init_sync=False), quiet_profiler(), \
                profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            torch.manual_seed(0)
            model = source.build()
            if recipe.precision == "bf16":
                model.to(torch.bfloat16)
            torch.manual_seed(1 + layout.data_rank(rank))  # the data-parallel rank's rows
            batch = source.make_batch(per_rank, case.get("seq_len"), None)
            model, _, step = apply(model, recipe, watch=_phases())
            if recipe.ep > 1:  # the routers choose as the estimate assumes (the all-to-all's sizes follow them)
                from memfit.techniques.expert_parallel import route

                route(model, case.get("moe_routing", "balanced"))
            gc.collect()
            with record_function("memfit::steps"):
                pass
            for _ in range(case.get("steps", 2)):
                step(batch)
            # what a GPU run keeps on the device through the optimizer step of an offloaded run
            resident = _bytes(list(model.buffers()) + batch_tensors(batch))
            with record_function("memfit::end"):
                pass
        events, marks = allocation_events(prof)
    finally:
        dist.destroy_process_group()
    # a phase mark repeats with accumulation (forward:0 per micro-batch): every one is kept
    (start, thread), (end, _) = marks.pop("memfit::steps")[0], marks.pop("memfit::end")[0]
    phases = sorted((when, name.split("::")[1]) for name, seen in marks.items() for when, _ in seen)
    live, peak, before, phase_peaks, where, whole = 0, 0, None, {}, 0, 0
    for when, nbytes in main_thread(events, thread):
        if when >= start and before is None:
            before = peak = live
        while where < len(phases) and phases[where][0] <= when:
            where += 1
        live += nbytes
        if when <= end:  # from before the model was built: what construction=device holds too
            whole = max(whole, live)
        if before is not None and when <= end:
            peak = max(peak, live)
            if where:
                name = phases[where - 1][1]
                phase_peaks[name] = max(phase_peaks.get(name, 0), live)
    return {"rank": rank, "world_size": size, "peak_bytes": peak, "peak_with_construction": whole,
            "live_at_start": before or live,
            "phase_peaks": phase_peaks, "buffers_and_batch": resident}


def _run_many(cases: list[dict], out: str) -> None:
    """Every case in turn, each on a process group of its own: ``DIR/case<i>-rank<r>.json``."""
    import torch.distributed as dist

    store, rank, _ = next(dist.rendezvous("env://"))
    for i, case in enumerate(cases):
        result = _run(case, store=dist.PrefixStore(f"memfit-case-{i}/", store))
        Path(out, f"case{i}-rank{rank}.json").write_text(json.dumps(result))
        gc.collect()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--case", help="JSON: model, recipe, batch_size, seq_len, steps")
    which.add_argument("--cases", help="a file holding a JSON list of cases, run in turn (DIR/case<i>-rank<r>.json)")
    parser.add_argument("--out", required=True, help="folder for rank<r>.json")
    args = parser.parse_args(argv)
    if args.cases:
        _run_many(json.loads(Path(args.cases).read_text()), args.out)
        return 0
    result = _run(json.loads(args.case))
    Path(args.out, f"rank{result['rank']}.json").write_text(json.dumps(result))
    return 0


def _torchrun(nproc: int, arguments: list[str], timeout: float) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "memfit.distributed.truth", *arguments]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode:
        raise RuntimeError(f"torchrun failed ({done.returncode}):\n{done.stderr[-4000:]}")


def launch(case: dict, nproc: int, timeout: float = 600) -> list[dict]:
    """Run ``case`` under ``torchrun --nproc_per_node nproc`` on this machine; each rank's result."""
    with tempfile.TemporaryDirectory() as out:
        _torchrun(nproc, ["--case", json.dumps(case), "--out", out], timeout)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(nproc)]


def launch_many(cases: list[dict], nproc: int, timeout: float | None = None) -> list[list[dict]]:
    """Run ``cases`` in turn in one ``torchrun --nproc_per_node nproc`` (one start-up for all); per case, each
    rank's result, as ``launch`` gives it for that case alone."""
    with tempfile.TemporaryDirectory() as out:
        listed = Path(out, "cases.json")
        listed.write_text(json.dumps(cases))
        _torchrun(nproc, ["--cases", str(listed), "--out", out], timeout or 300 * (len(cases) + 1))
        return [[json.loads(Path(out, f"case{i}-rank{r}.json").read_text()) for r in range(nproc)]
                for i in range(len(cases))]


if __name__ == "__main__":
    sys.exit(main())
