"""Feasibility probe, part 2: DeepSpeed's own engine on FAKE tensors under PyTorch's fake process group, one
rank of a world of N, its allocations recorded by memfit's own Ledger (PYTHONPATH=/work/main/src).

    DS_ACCELERATOR=cpu PYTHONPATH=/work/main/src venv/bin/python probe_fake.py --case z2 [--rank 0] [--world 2]

Same model, config and steps as probe.py; prints the peak over the steps, the live bytes when they begin and
each phase's peak, to set beside probe.py's truth (which counts the CPU allocator's events of a real run).
What had to be patched for DeepSpeed to run on fake tensors is listed in PATCHES as it is applied.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from probe import BATCH, CASES, HIDDEN, _config, _model  # noqa: E402

PATCHES: list[str] = []


def _patch_deepspeed():
    """What fake tensors cannot do, done for DeepSpeed: each patch named in PATCHES."""
    import deepspeed.runtime.zero.stage_1_and_2 as s12

    # 1. stage 1/2 asserts every partition's data_ptr is 4-byte aligned: a fake tensor has no data pointer
    real_data_ptr = torch.Tensor.data_ptr

    def data_ptr(self):
        try:
            return real_data_ptr(self)
        except Exception:
            return 0

    torch.Tensor.data_ptr = data_ptr
    PATCHES.append("Tensor.data_ptr -> 0 where a fake tensor has none (stage 1/2 alignment assert)")

    # scalar reads (.item(), bool(), overflow flags, norms) are answered by memfit's ScalarReads (0 / False)
    del s12
    # stage 3 checks that every rank traced the same modules by reading lists back from rank 0 (values that a
    # fake process group does not move): a sanity check only
    import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator
    import deepspeed.runtime.zero.utils as zero_utils

    for module in (coordinator, zero_utils):
        for name in ("assert_ints_same_as_other_ranks", "assert_lst_len_same_as_other_ranks"):
            if hasattr(module, name):
                setattr(module, name, lambda *args, **kwargs: None)
    PATCHES.append("stage 3's assert_ints_same_as_other_ranks -> no-op (reads rank 0's list through a collective)")


def run(case: str, steps: int, rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29599", LOCAL_SIZE=str(world))
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    t0 = time.monotonic()
    import deepspeed

    __import__("importlib").import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # (deepspeed.comm.torch the attribute is the torch package)  # the CPU accelerator's JIT shm all-reduce op: not for training
    from memfit.accounting.ledger import ALLOC, FREE, MARK, Ledger, storage_events
    from memfit.categories import Category
    from memfit.estimator.fake import ScalarReads

    t_import = time.monotonic() - t0
    _patch_deepspeed()
    spec = CASES[case]
    config = _config(spec)
    gas = config["gradient_accumulation_steps"]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    t1 = time.monotonic()
    error = None
    class MetaBlindLedger(Ledger):
        """memfit's Ledger counts a fake tensor made on the meta device (DeepSpeed keeps
        ``torch.zeros_like(p, device="meta")`` shape records, stage_1_and_2.py:482-488) as memory: skip them."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            device = (kwargs or {}).get("device")
            if device is not None and torch.device(device).type == "meta":
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    PATCHES.append("Ledger ignores ops that make meta-device tensors (DeepSpeed's shape records)")
    ledger = MetaBlindLedger(device=torch.device("cpu"))
    reads = ScalarReads()
    try:
        with mode, reads:
            torch.manual_seed(0)
            model = _model()
            # the engine's module.to(device) (engine.py:2094) swaps each fake parameter for itself and fails
            # ("Couldn't swap Linear.weight"): the model is already on the device
            model.to = lambda *args, **kwargs: model
            PATCHES.append("model.to -> model (engine.py:2094 module.to(device) cannot swap fake parameters)")
            with ledger:
                for p in model.parameters():
                    ledger.register(p, Category.PARAMETERS)
                ledger.begin("initialize", 0)
                engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                       config=config)
                ledger.begin("steps", 0)
                dtype = torch.bfloat16 if spec.get("bf16", True) else torch.float32
                x = torch.randn(BATCH, HIDDEN, dtype=dtype)
                llama = os.environ.get("PROBE_MODEL") == "llama"
                if llama:
                    x = torch.randint(0, 509, (BATCH, 32))
                for step in range(steps):
                    for micro in range(gas):
                        ledger.begin("forward", step)
                        loss = engine(input_ids=x, labels=x).loss if llama else engine(x).float().pow(2).mean()
                        ledger.begin("backward", step)
                        engine.backward(loss)
                        ledger.begin("optimizer", step)
                        engine.step()
                ledger.begin("end", 0)
            ledger.close()
    except Exception as exc:  # what breaks on fake tensors is the finding
        import traceback

        error = "".join(traceback.format_exception(exc)[-6:])
    wall = time.monotonic() - t1
    live = peak = 0
    before = None
    phase, phase_peaks, init_peak = "setup", {}, 0
    for kind, index in storage_events(ledger):
        if kind == MARK:
            phase = "{}:{}".format(*ledger.marks[index])
            if phase == "steps:0":
                before = peak = live
            continue
        if kind == ALLOC:
            live += ledger.records[index].nbytes
        elif kind == FREE:
            live -= ledger.records[index].nbytes
        if phase.startswith("initialize"):
            init_peak = max(init_peak, live)
        if before is not None and not phase.startswith("end"):
            peak = max(peak, live)
            phase_peaks[phase] = max(phase_peaks.get(phase, 0), live)
    if os.environ.get("PROBE_DEBUG"):  # the records live when the steps begin
        alive, step_mark = {}, None
        for kind, index in storage_events(ledger):
            if kind == MARK:
                if ledger.marks[index][0] == "steps":
                    break
                continue
            if kind == ALLOC:
                alive[index] = ledger.records[index]
            elif kind == FREE:
                alive.pop(index, None)
        for index, record in alive.items():
            print("live at steps:", index, record.nbytes, record.category, record.phase, record.module)
        mark = None
        for kind, index in storage_events(ledger):
            if kind == MARK:
                mark = ledger.marks[index]
            elif kind == FREE and index in alive:
                print("freed later:", index, "in", mark)
    return {"case": case, "rank": rank, "world_size": world, "error": error, "patches": PATCHES,
            "peak_bytes": peak, "live_at_start": before, "init_peak": init_peak, "phase_peaks": phase_peaks,
            "records": len(ledger.records), "scalar_reads": reads.reads, "import_s": round(t_import, 2), "run_s": round(wall, 2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", required=True, choices=sorted(CASES))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    result = run(args.case, args.steps, args.rank, args.world)
    text = json.dumps(result, indent=1)
    if args.out:
        with open(os.path.join(args.out, f"fake-{args.case}-rank{args.rank}.json"), "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
