"""Published DeepSpeed ZeRO runs that users reported with their memory, estimated by memfit from the same config file.

LLaMA-Factory#1221 (2023-10-18, https://github.com/hiyouga/LlamaFactory/issues/1221): a full fine-tune of LLaMA-7B on
8 x V100-32GB with "the deepspeed zero stage2 example config in the readme" (fp16 "auto", stage 2, 5e8 buckets,
``overlap_comm`` false), one row a GPU, ran out of memory at the first optimizer step in torch's single-tensor Adam
(``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)``): "Tried to allocate 3.14 GiB (GPU 5; 31.75 GiB
total capacity; 28.28 GiB already allocated ...)". So that step needed 28.28 + 3.14 = 31.42 GiB allocated; with stage 3
the same run trained. memfit reads each config as ``memfit estimate --from ds_config.json`` does (the Trainer's
``fp16``, its default ``adamw_torch`` stepping tensor by tensor as the traceback shows), LLaMA-Factory's default
``cutoff_len`` of 1024 (the optimizer step the report caught holds no activation: the sequence does not move it), and
DeepSpeed's own estimator (``estimate_zero2/3_model_states_mem_needs``, model states only) is shown beside it.

LLaMA-Factory#5977 (2024-11-09): Llama-3-8B-Instruct full SFT on 8 x RTX 3090 with LLaMA-Factory's ds_z3_config.json
ran out of memory; with ds_z3_offload_config.json it trained ("each card only 13G", no peak measured). A row a GPU,
accumulation 2, cutoff_len 1024 (its data unpacked: a longest row of at most that), fp16, LLaMA-Factory's default
gradient checkpointing.

    python -m bench deepspeed_reports
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file

import memfit  # noqa: E402
from memfit.estimator.verdict import OOM  # noqa: E402
from memfit.techniques.recipe import Recipe  # noqa: E402
from memfit.trainers.deepspeed_config import read_ds_config  # noqa: E402
from bench import _results  # noqa: E402
from bench.distributed.deepspeed import deepspeed_estimator  # noqa: E402

RESULTS = "deepspeed-reports.json"
GiB = 2**30

_FP16 = {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
         "min_loss_scale": 1}
_TRAINER = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "zero_allow_untested_optimizer": True, "fp16": _FP16}
# LLaMA-Factory's README examples of the time (stage 2), and its stage-3 one
Z2 = {**_TRAINER, "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 5e8,
                                        "reduce_scatter": True, "reduce_bucket_size": 5e8, "overlap_comm": False,
                                        "contiguous_gradients": True}}
Z3 = {**_TRAINER, "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                                        "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                                        "stage3_prefetch_bucket_size": "auto",
                                        "stage3_param_persistence_threshold": "auto",
                                        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                                        "stage3_gather_16bit_weights_on_model_save": True}}

# LLaMA-Factory's examples/deepspeed/ds_z3_config.json and ds_z3_offload_config.json as stored at commit 98ea0e81
# (before their monitor sections; the zero sections are the same today): overlap_comm false, pinned offloads
_Z3_LF = {"stage": 3, "overlap_comm": False, "contiguous_gradients": True, "sub_group_size": 1e9,
          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
          "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
          "stage3_gather_16bit_weights_on_model_save": True}
Z3_LF = {**_TRAINER, "bf16": {"enabled": "auto"}, "zero_optimization": _Z3_LF}
Z3_LF_OFFLOAD = {**_TRAINER, "bf16": {"enabled": "auto"},
                 "zero_optimization": {**_Z3_LF, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                       "offload_param": {"device": "cpu", "pin_memory": True}}}

REPORTS = [
    {"name": "llama-factory-1221-zero2", "model": "llama-2-7b", "gpu": "v100-32gb", "gpus": 8, "rows_per_gpu": 1,
     "seq_len": 1024, "config": Z2, "reported": "OOM at Adam's exp_avg_sq.sqrt(): 28.28 GiB allocated + 3.14 GiB asked",
     "reported_bytes": int((28.28 + 3.14) * GiB), "reported_fits": False},
    {"name": "llama-factory-1221-zero3", "model": "llama-2-7b", "gpu": "v100-32gb", "gpus": 8, "rows_per_gpu": 1,
     "seq_len": 1024, "config": Z3, "reported": "trained (the same run with stage 3)", "reported_bytes": None,
     "reported_fits": True},
    # LLaMA-Factory#5977 (2024-11-09, https://github.com/hiyouga/LlamaFactory/issues/5977): Meta-Llama-3-8B-Instruct
    # (Llama-3.1-8B's shapes), full SFT on 8 x RTX 3090, per_device_train_batch_size 1, gradient_accumulation_steps 2,
    # cutoff_len 1024, fp16, LLaMA-Factory's default gradient checkpointing: with ds_z3_config.json it ran out of
    # memory; with ds_z3_offload_config.json it trained, "each card only using 13G" (the maintainer: "normal").
    {"name": "llama-factory-5977-zero3", "model": "llama-3.1-8b", "gpu": "rtx-3090", "gpus": 8, "rows_per_gpu": 1,
     "accum": 2, "seq_len": 1024, "checkpointing": "blocks", "config": Z3_LF, "reported": "out of memory",
     "reported_bytes": None, "reported_fits": False},
    {"name": "llama-factory-5977-zero3-offload", "model": "llama-3.1-8b", "gpu": "rtx-3090", "gpus": 8,
     "rows_per_gpu": 1, "accum": 2, "seq_len": 1024, "checkpointing": "blocks", "config": Z3_LF_OFFLOAD,
     "reported": "trained, about 13 GB a card", "reported_bytes": None, "reported_fits": True},
]


def main(argv=None) -> int:
    rows = []
    for report in REPORTS:  # each a few tens of seconds: DeepSpeed's engine on fake tensors, rank 0 and the last
        fields, _ = read_ds_config(report["name"], report["config"])
        accum = report.get("accum", 1)
        recipe = Recipe(**fields, precision="fp16", optimizer_impl="forloop", grad_accum_steps=accum,
                        checkpointing=report.get("checkpointing", "off"))
        estimate = memfit.estimate(report["model"], recipe=recipe, gpu=report["gpu"], gpus=report["gpus"],
                                   batch_size=report["rows_per_gpu"] * report["gpus"] * accum,
                                   seq_len=report["seq_len"])
        peak = max(r["peak_bytes"] for r in estimate.ranks)
        theirs = deepspeed_estimator(report["model"], int(recipe.parallel[-1]), report["gpus"])
        fits = estimate.verdict != OOM
        gap = None if report["reported_bytes"] is None else round(peak / report["reported_bytes"] - 1, 4)
        rows.append({"name": report["name"], "model": report["model"], "gpu": report["gpu"], "gpus": report["gpus"],
                     "recipe": recipe.describe(), "reported": report["reported"],
                     "reported_bytes": report["reported_bytes"], "reported_fits": report["reported_fits"],
                     "memfit_peak_bytes": peak, "memfit_device_bytes": estimate.device_bytes,
                     "memfit_verdict": estimate.verdict, "memfit_phase_peaks": estimate.phase_peaks, "gap": gap,
                     "verdict_right": fits == report["reported_fits"], "deepspeed_estimator_bytes": theirs})
        print(f"{report['name']:26} memfit {peak / GiB:6.2f} GiB allocated at the peak, {estimate.verdict}; "
              f"reported: {report['reported']}" + (f" (gap {100 * gap:+.2f} %)" if gap is not None else "")
              + f"; DeepSpeed's estimator {theirs / GiB:.2f} GiB", flush=True)
    _results.write(RESULTS, rows, {"verdicts_right": sum(r["verdict_right"] for r in rows), "reports": len(rows),
                                   "worst_abs_gap": max(abs(r["gap"]) for r in rows if r["gap"] is not None)},
                   deepspeed="0.19.8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
