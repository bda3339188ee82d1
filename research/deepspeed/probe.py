"""Feasibility probe for memfit issue 51: a real DeepSpeed ZeRO engine on CPU, each rank's peak from the CPU
allocator's own events (torch.profiler profile_memory), as memfit's FSDP2 truths measure theirs.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 probe.py --case z2 --out DIR

Each rank writes DIR/<case>-rank<r>.json: the peak over the training steps (main thread only: gloo's worker
threads' staging copies are left out, as memfit's truth does), the live bytes when the steps begin, each
phase's peak (forward / backward / step, per step), the init peak (deepspeed.initialize) and the analytic
model-state sizes this rank should hold, so one can see the profiler sees DeepSpeed's own buffers.

Cases (``CASES`` below): stages 1/2/3, default and small buckets, overlap on/off, bf16 and fp32, stage-3
prefetch/persistence, optimizer offload, gradient accumulation. Model: a tiny MLP whose sizes do not divide
by the world size (257), so DeepSpeed's padding shows.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

HIDDEN, INNER, BLOCKS, BATCH = 257, 1024, 2, 8

BASE_ZERO = {}
CASES = {
    # stage 1 with bf16: DeepSpeedZeroOptimizer(partition_grads=False); bucket 5e8 bf16 allocated in backward
    "z1": dict(stage=1),
    "z1-small": dict(stage=1, zero=dict(reduce_bucket_size=50000, allgather_bucket_size=50000)),
    # stage 1 + bf16 + fp32 grad accumulation: BF16_Optimizer (full fp32 grad buffer)
    "z1-bf16opt": dict(stage=1, extra={"data_types": {"grad_accum_dtype": "fp32"}}),
    "z2": dict(stage=2),
    "z2-small": dict(stage=2, zero=dict(reduce_bucket_size=50000, allgather_bucket_size=50000)),
    "z2-overlap": dict(stage=2, zero=dict(overlap_comm=True, reduce_bucket_size=50000)),
    "z2-nocontig": dict(stage=2, zero=dict(contiguous_gradients=False, reduce_bucket_size=50000)),
    "z2-fp32": dict(stage=2, bf16=False, zero=dict(reduce_bucket_size=50000)),
    "z2-accum": dict(stage=2, gas=2, zero=dict(reduce_bucket_size=50000)),
    "z2-offload": dict(stage=2, zero=dict(reduce_bucket_size=50000, offload_optimizer={"device": "cpu"})),
    "z3": dict(stage=3),
    "z3-small": dict(stage=3, zero=dict(reduce_bucket_size=50000, stage3_prefetch_bucket_size=50000,
                                        stage3_param_persistence_threshold=1000, stage3_max_live_parameters=300000,
                                        stage3_max_reuse_distance=0)),
    "z3-offload": dict(stage=3, zero=dict(reduce_bucket_size=50000, offload_optimizer={"device": "cpu"},
                                          offload_param={"device": "cpu"})),
}


def _config(spec: dict) -> dict:
    zero = {"stage": spec["stage"], **spec.get("zero", {})}
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": spec.get("gas", 1),
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if spec.get("bf16", True):
        config["bf16"] = {"enabled": True}
    config.update(spec.get("extra", {}))
    return config


def _model():
    if os.environ.get("PROBE_MODEL") == "llama":  # a tiny random Llama (transformers), sizes not divisible by 2
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=509, hidden_size=96, intermediate_size=257, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             attn_implementation="eager")
        return LlamaForCausalLM(config)
    layers = []
    for _ in range(BLOCKS):
        layers += [torch.nn.Linear(HIDDEN, INNER), torch.nn.GELU(), torch.nn.Linear(INNER, HIDDEN)]
    layers.append(torch.nn.Linear(HIDDEN, 1))
    return torch.nn.Sequential(*layers)


# --- the truth's measuring, as memfit/distributed/truth.py does it ---------------------------------------------
_BACKEND = ("c10d::", "gloo:", "record_param_comms")
SETTLE_SLEEP = float(os.environ.get("PROBE_SETTLE_SLEEP", "0.002"))


def allocation_events(prof):
    from torch._C._profiler import _EventType

    found, marks = [], {}

    def walk(node, backend=False):
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            found.append((node.start_time_ns, fields.alloc_size, -1 if backend else node.start_tid, fields.ptr))
            return
        backend = backend or node.name.startswith(_BACKEND)
        if node.name.startswith("probe::"):
            marks.setdefault(node.name, []).append((node.start_time_ns, node.start_tid))
        for child in node.children:
            walk(child, backend)

    for event in prof.profiler.kineto_results.experimental_event_tree():
        walk(event)
    found.sort(key=lambda item: item[0])
    return found, marks


def main_thread(events, thread):
    """memfit's rule (main thread's allocations, their frees wherever they happen), plus: an allocation at an
    address still live was preceded by that block's free, whose event sorted after it — a free on gloo's
    worker thread and the main thread's reuse of the address within the profiler's clock skew (seen in
    stage 3: a whole gathered weight counted twice, on a random rank, in 1 run of 2)."""
    own, kept = {}, []
    for start, size, tid, ptr in events:
        if size > 0:
            if tid != thread:
                continue
            if ptr in own:  # the earlier block's free, late in the log
                kept.append((start, -own.pop(ptr)))
            own[ptr] = size
        elif ptr not in own:
            continue
        else:
            own.pop(ptr)
        kept.append((start, size))
    return kept


class _Done:
    """The handle of a collective that has completed."""

    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


def _settled(collective):
    """gloo's wait() returns while its worker still holds the tensors: wait until it lets go (memfit's truth)."""

    def count(tensor):
        return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)

    def call(*args, **kwargs):
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        tensors += [t for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple))
                    for t in a if isinstance(t, torch.Tensor)]
        before = [count(t) for t in tensors]
        # an async call (stage 3's all-gathers, engine.py's async reductions) runs synchronously here: the returned
        # Work holds its tensors, so their counts could not settle while the caller keeps it. The estimate's fake
        # process group completes every collective at once too.
        asynchronous = kwargs.pop("async_op", False)
        out = collective(*args, **kwargs)
        deadline = time.monotonic() + 5
        while any(count(t) > b for t, b in zip(tensors, before)) and time.monotonic() < deadline:
            time.sleep(0)
        # gloo's worker holds the op's at::Tensors (not new storage references, so the count above cannot see
        # them) until just after it marks the work complete: give it that moment, or the caller's free of a
        # temporary it reduced (a flattened bucket) happens on the worker's thread, unrecorded or late
        if SETTLE_SLEEP:
            time.sleep(SETTLE_SLEEP)
        return _Done() if asynchronous else out

    return call


_SKIP_BROADCAST = []


def settle_collectives():
    import torch.distributed as dist

    for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "reduce",
                 "all_gather", "reduce_scatter"):
        setattr(dist, name, _settled(getattr(dist, name)))
    settled_broadcast = dist.broadcast

    def broadcast(*args, **kwargs):
        """Skipped while the engine starts: every rank builds the same weights (seed 0), as memfit's DDP truth
        skips DDP's. DeepSpeed broadcasts ``p.data.view(uint8)`` (engine.py:2054-2061; stage 3 per param,
        partition_parameters.py:1200-1207): gloo's worker holds that temporary view, not a new reference to
        the storage, so waiting on the storage's use count does not settle it, and the parameter's storage was
        then freed on gloo's thread, where the profiler records no free (a whole weight left "live", at random)."""
        if _SKIP_BROADCAST:
            return _Done() if kwargs.get("async_op") else None
        return settled_broadcast(*args, **kwargs)

    dist.broadcast = broadcast


def _mark(name):
    with torch.profiler.record_function(f"probe::{name}"):
        pass


def run(case: str, steps: int, out: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    spec = CASES[case]
    torch.set_num_threads(1)
    settle_collectives()  # before deepspeed captures torch.distributed's functions
    t0 = time.monotonic()
    import deepspeed
    import torch.distributed as dist

    # the CPU accelerator's TorchBackend JIT-builds a shared-memory all-reduce op (deepspeed_shm_comm, g++ +
    # ninja, ~5 min here) used only by inference_all_reduce: training on gloo never calls it
    __import__("importlib").import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # (deepspeed.comm.torch the attribute is the torch package)
    t_import = time.monotonic() - t0
    deepspeed.init_distributed(dist_backend="gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    config = _config(spec)
    gas = config["gradient_accumulation_steps"]
    gc.collect()
    t1 = time.monotonic()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _mark("build")
        torch.manual_seed(0)
        model = _model()
        _mark("initialize")
        _SKIP_BROADCAST.append(True)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        _SKIP_BROADCAST.clear()
        gc.collect()
        _mark("steps")
        torch.manual_seed(1 + rank)
        dtype = torch.bfloat16 if spec.get("bf16", True) else torch.float32
        x = torch.randn(BATCH, HIDDEN, dtype=dtype)
        llama = os.environ.get("PROBE_MODEL") == "llama"
        if llama:
            x = torch.randint(0, 509, (BATCH, 32))
        for step in range(steps):
            for micro in range(gas):
                _mark(f"forward:{step}.{micro}")
                loss = engine(input_ids=x, labels=x).loss if llama else engine(x).float().pow(2).mean()
                _mark(f"backward:{step}.{micro}")
                engine.backward(loss)
                _mark(f"step:{step}.{micro}")
                engine.step()  # DeepSpeed steps the optimizer only at the accumulation boundary
        _mark("end")
    wall = time.monotonic() - t1
    events, marks = allocation_events(prof)
    thread = marks["probe::steps"][0][1]
    order = sorted((when, name.split("::")[1]) for name, seen in marks.items() for when, _ in seen)
    live = peak = init_peak = 0
    before = None
    phase_peaks, where = {}, 0
    start, end = marks["probe::steps"][0][0], marks["probe::end"][0][0]
    init_at = marks["probe::initialize"][0][0]
    for when, nbytes in main_thread(events, thread):
        while where < len(order) and order[where][0] <= when:
            where += 1
        if when >= start and before is None:
            before = peak = live
        live += nbytes
        if init_at <= when < start:
            init_peak = max(init_peak, live)
        if before is not None and when <= end:
            peak = max(peak, live)
            if where:
                name = order[where - 1][1]
                phase_peaks[name] = max(phase_peaks.get(name, 0), live)
    if os.environ.get("PROBE_DEBUG"):  # blocks over 100 kB live when the steps begin: size, thread, allocating op
        from torch._C._profiler import _EventType

        where_made = {}

        def walk(node, names=()):
            if node.tag == _EventType.Allocation:
                f = node.extra_fields
                if f.alloc_size > 0:
                    where_made[(f.ptr, node.start_time_ns)] = (f.alloc_size, node.start_tid, "/".join(names[-3:]))
                return
            for child in node.children:
                walk(child, names + (node.name,))

        for event in prof.profiler.kineto_results.experimental_event_tree():
            walk(event)
        alive = {}
        for when, size, tid, ptr in events:  # memfit's main-thread rule, as main_thread() applies it
            if when >= start:
                break
            if size > 0:
                if tid == thread:
                    alive[ptr] = (when, size, tid)
            else:
                alive.pop(ptr, None)
        freed_later = {ptr for when, size, tid, ptr in events if when >= start and size < 0}
        for ptr, (when, size, tid) in sorted(alive.items(), key=lambda kv: kv[1][0]):
            if size > 100_000:
                made = where_made.get((ptr, when), (size, tid, "?"))
                print(f"rank {rank} live at steps: {size} tid={'main' if tid == thread else tid} by {made[2]}"
                      f" freed_later={ptr in freed_later}", flush=True)
    opt = engine.optimizer
    result = {
        "case": case, "rank": rank, "world_size": size, "config": config,
        "optimizer": type(opt).__name__, "basic_optimizer": type(engine.basic_optimizer).__name__,
        "peak_bytes": peak, "live_at_start": before, "init_peak": init_peak, "phase_peaks": phase_peaks,
        "events": len(events), "import_s": round(t_import, 2), "run_s": round(wall, 2),
        "params": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters()),
    }
    # what this rank holds by DeepSpeed's own bookkeeping, to compare with live_at_start
    held = {}
    for name in ("bit16_groups_flat", "single_partition_of_fp32_groups", "bf16_groups_flat",
                 "fp32_groups_flat_partition", "fp32_groups_gradients_flat", "fp32_partitioned_groups_flat"):
        tensors = getattr(opt, name, None)
        if tensors:
            held[name] = sum(t.numel() * t.element_size() for t in tensors if t is not None)
    for name in ("lp_param_buffer", "grad_partitions_flat_buffer"):
        t = getattr(opt, name, None)
        if isinstance(t, torch.Tensor):
            held[name] = t.numel() * t.element_size()
    state = getattr(opt, "optimizer", opt).state if hasattr(getattr(opt, "optimizer", opt), "state") else {}
    held["adam_state"] = sum(v.numel() * v.element_size() for s in state.values() for v in s.values()
                             if isinstance(v, torch.Tensor) and v.dim() > 0)
    buckets = getattr(opt, "ipg_buckets", {})
    for dtype, bucket in buckets.items():
        buf = bucket.buffer
        tensors = buf if isinstance(buf, list) else [buf] if buf is not None else []
        held[f"ipg_bucket_{dtype}"] = sum(t.numel() * t.element_size() for t in tensors)
    result["held_after_steps"] = held
    Path(out, f"{case}-rank{rank}.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", required=True, choices=sorted(CASES))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    result = run(args.case, args.steps, args.out)
    if result["rank"] == 0:
        print(json.dumps({k: result[k] for k in ("case", "optimizer", "peak_bytes", "live_at_start", "init_peak",
                                                 "import_s", "run_s")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
