"""Per-rank estimates of DeepSpeed ZeRO 1/2/3 steps against real 2-rank DeepSpeed runs on this CPU (gloo).

Each case runs DeepSpeed 0.19.8's engine for real under ``torchrun --nproc_per_node 2`` (``memfit.distributed.truth``:
the same ``memfit.apply`` as the estimate, each rank's peak over 4 steps from its own CPU allocator events) and is
estimated by ``memfit.estimate(..., gpus=2, device="cpu")`` (the same engine on fake tensors over PyTorch's fake
process group). The cases cover issue 51's list: stages 1/2/3, DeepSpeed's default buckets (5e8 elements: a 1 GB
bf16 bucket that a CPU run allocates without touching) and small ones, overlap_comm, contiguous gradients off, fp32
and bf16, stage 1's BF16_Optimizer (fp32 gradient accumulation), stage 3's prefetch / persistence / live /
reuse-distance settings, optimizer (and stage 3 parameter) offload, and accumulation. Beside each, DeepSpeed's own
estimator (``estimate_zero2/3_model_states_mem_needs``: model states only; none for the offloaded cases, whose host and
device are one memory here). Prints one row per case and rank and writes ``bench/results/deepspeed-cpu.json``.

    python -m bench deepspeed [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file

import memfit  # noqa: E402
from memfit.distributed.truth import launch_many  # noqa: E402
from memfit.techniques.recipe import Recipe  # noqa: E402
from bench import _results  # noqa: E402

RESULTS = "deepspeed-cpu.json"

# a tiny Llama whose sizes do not divide by 2: DeepSpeed pads its partitions, and a parameter straddles two
MODEL = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 509, "hidden_size": 96,
         "intermediate_size": 257, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64}
SHAPE = dict(batch_size=16, seq_len=32, steps=4)  # 8 rows a rank; stage 3's trace is steady from step 3
SMALL = "reduce_bucket_size=50000,allgather_bucket_size=50000"
BF16 = dict(precision="bf16", attention="eager")
CASES = {
    "z1": dict(parallel="zero1", **BF16),
    "z1-small": dict(parallel="zero1", zero=SMALL, **BF16),
    "z1-bf16-optimizer": dict(parallel="zero1", zero="grad_accum_dtype=fp32", **BF16),  # DeepSpeed's BF16_Optimizer
    "z2": dict(parallel="zero2", **BF16),
    "z2-small-overlap": dict(parallel="zero2", zero=SMALL + ",overlap_comm=true", **BF16),
    "z2-not-contiguous": dict(parallel="zero2", zero="reduce_bucket_size=50000,contiguous_gradients=false", **BF16),
    "z2-fp32": dict(parallel="zero2", zero="reduce_bucket_size=50000", attention="eager"),
    "z2-accumulation": dict(parallel="zero2", zero="reduce_bucket_size=50000", grad_accum_steps=2, **BF16),
    "z2-offload": dict(parallel="zero2", zero="reduce_bucket_size=50000,offload_optimizer=cpu", **BF16),
    # QLoRA (bitsandbytes' NF4) under ZeRO-2: the 4-bit base whole on each rank, the adapters' states partitioned
    "z2-qlora": dict(parallel="zero2", zero="reduce_bucket_size=50000", lora="qlora:8", **BF16),
    "z2-qlora-offload": dict(parallel="zero2", zero="reduce_bucket_size=50000,offload_optimizer=cpu", lora="qlora:8",
                             **BF16),
    "z3": dict(parallel="zero3", **BF16),
    "z3-small": dict(parallel="zero3", zero="reduce_bucket_size=50000,stage3_prefetch_bucket_size=50000,"
                     "stage3_param_persistence_threshold=1000,stage3_max_live_parameters=300000,"
                     "stage3_max_reuse_distance=0", **BF16),
    "z3-offload": dict(parallel="zero3", zero="reduce_bucket_size=50000,offload_optimizer=cpu,offload_param=cpu",
                       **BF16),
    # QLoRA under ZeRO-3: the 4-bit codes packed as bf16 (transformers' bnb_4bit_quant_storage) and partitioned
    "z3-qlora": dict(parallel="zero3", zero="reduce_bucket_size=50000,stage3_prefetch_bucket_size=50000,"
                     "stage3_param_persistence_threshold=1000", lora="qlora:8", **BF16),
    "z3-qlora-offload": dict(parallel="zero3", zero="reduce_bucket_size=50000,offload_optimizer=cpu,offload_param=cpu",
                             lora="qlora:8", **BF16),
}


def deepspeed_estimator(model, stage: int, gpus: int) -> int:
    """Bytes a GPU needs by DeepSpeed's own estimator (model states only: no activations, buckets or temporaries),
    without offload; for stage 1 its stage-2 estimator (DeepSpeed has none for stage 1)."""
    import torch
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from memfit.models.source import resolve

    with torch.device("meta"):
        built = resolve(model).build()
    total = sum({id(p): p.numel() for p in built.parameters()}.values())
    if stage < 3:
        return estimate_zero2_model_states_mem_needs(total, num_gpus_per_node=gpus, cpu_offload=False)[1]
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in built.modules())
    return estimate_zero3_model_states_mem_needs(total, largest, num_gpus_per_node=gpus, cpu_offload=False,
                                                 cpu_offload_params=False)[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=sorted(CASES), help="these cases (writes nothing)")
    args = parser.parse_args(argv)
    names = args.only or list(CASES)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "config.json")
        path.write_text(json.dumps(MODEL))
        start = time.monotonic()
        truths = launch_many([{"model": str(path), "recipe": CASES[n], **SHAPE} for n in names], 2)
        truth_seconds = time.monotonic() - start
        rows = []
        for name, ranks in zip(names, truths):
            start = time.monotonic()
            report = memfit.estimate(str(path), recipe=Recipe(**CASES[name]), gpus=2, device="cpu", **SHAPE)
            seconds = round(time.monotonic() - start, 1)
            estimated = {r["rank"]: r["peak_bytes"] for r in report.ranks}
            recipe = Recipe(**CASES[name])
            theirs = None if "offload" in recipe.zero else deepspeed_estimator(str(path), int(recipe.parallel[-1]), 2)
            for rank in ranks:
                mine = estimated.get(rank["rank"], estimated[0])  # a rank not traced holds what rank 0 holds
                error = (mine - rank["peak_bytes"]) / rank["peak_bytes"]
                rows.append({"case": name, "recipe": CASES[name], "rank": rank["rank"],
                             "truth_peak_bytes": rank["peak_bytes"], "estimate_peak_bytes": mine,
                             "error": round(error, 7), "estimate_seconds": seconds,
                             "traced_ranks": sorted(estimated), "deepspeed_estimator_bytes": theirs,
                             "deepspeed_estimator_error": None if theirs is None else
                             round((theirs - rank["peak_bytes"]) / rank["peak_bytes"], 4)})
                print(f"{name:18} rank {rank['rank']}: truth {rank['peak_bytes']:>13,}  estimate {mine:>13,}  "
                      f"{100 * error:+.4f} %", flush=True)
    worst = max(abs(r["error"]) for r in rows)
    theirs = [abs(r["deepspeed_estimator_error"]) for r in rows if r["deepspeed_estimator_error"] is not None]
    print(f"worst {100 * worst:.4f} % over {len(rows)} rank(s) of {len(names)} case(s); truths {truth_seconds:.0f} s")
    if not args.only:
        _results.write(RESULTS, rows, {"worst_abs_error": worst, "cases": len(names), "ranks": len(rows),
                                       "deepspeed_estimator_median_abs_error": sorted(theirs)[len(theirs) // 2],
                                       "truth_seconds": round(truth_seconds)},
                       device=f"{_results.device_name()}, gloo, 2 ranks", deepspeed="0.19.8", model=MODEL, **SHAPE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
