"""The depth fast path against the full trace, on catalog models, recipes and GPUs.

    python -m bench fast_vs_full                 # every case; writes bench/results/fast-vs-full.json
    python -m bench fast_vs_full --only demo     # cases whose name contains "demo" (merged into the file)
    python -m bench fast_vs_full --only fsdp     # one rank of FSDP2 at 8 to 64 ranks
    python -m bench fast_vs_full --only pp       # every pipeline stage (1F1B over FSDP2 x TP), 405B's included

Each case runs ``memfit.estimate(..., fast=True)`` (a 4-block copy traced, its allocation log
written out at full depth and replayed: ``depth.py``, ``accounting/synth.py``) and
``fast=False`` (every block traced), and records the allocated peak, the reserved peak and the
device bytes (reserved + CUDA context) of both, their relative differences and wall times; with
pipeline stages (or any per-rank estimate) every traced rank's figures (``ranks``). The full trace is
the independent truth: the same step, traced block by block.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file
os.environ.setdefault("MEMFIT_DEVICE", "cpu")  # graded by the CPU allocator: CPU semantics (the default is CUDA)
os.environ.setdefault("KINETO_LOG_LEVEL", "6")


import memfit  # noqa: E402
from memfit.techniques.recipe import Recipe  # noqa: E402
from bench import _results  # noqa: E402

RESULTS = "fast-vs-full.json"
BF16 = {"precision": "bf16-mixed"}
FSDP = {"parallel": "fsdp"}
DEMO = dict(BF16, checkpointing="blocks", chunked_loss=8, micro_batch_size=8, grad_accum_steps=8, lora="qlora:16")
# (name, model, recipe fields, gpu or None for CPU semantics, seq_len, batch_size)
CASES = [
    ("demo 8b qlora", "llama-3.1-8b", DEMO, "rtx-4090", 2048, 1),
    ("demo plan pick, 3 micro-batches", "llama-3.1-8b",
     dict(BF16, checkpointing="blocks:2", micro_batch_size=1, grad_accum_steps=3, lora="qlora:16"), "rtx-4090", 2048, 1),
    ("1b bf16 s2048", "llama-3.2-1b", BF16, "rtx-4090", 2048, 1),
    ("3b accum 1x2", "llama-3.2-3b", dict(micro_batch_size=1, grad_accum_steps=2), "h100-sxm", 2048, 1),
    ("3b bf16 accum 1x2", "llama-3.2-3b", dict(BF16, micro_batch_size=1, grad_accum_steps=2), "h100-sxm", 2048, 1),
    ("1b fp32 plain", "llama-3.2-1b", {}, "a100", 512, 2),
    ("1b ckpt blocks", "llama-3.2-1b", dict(BF16, checkpointing="blocks"), "h100-sxm", 1024, 2),
    ("1b ckpt every-2nd", "llama-3.2-1b", dict(BF16, checkpointing="blocks:2"), "rtx-4090", 1024, 2),
    ("1b ckpt selective", "llama-3.2-1b", dict(BF16, checkpointing="selective"), "a100", 1024, 2),
    ("1b chunked loss", "llama-3.2-1b", dict(BF16, chunked_loss=4), "rtx-4090", 1024, 2),
    ("1b offload", "llama-3.2-1b", dict(BF16, offload_activations=True), "h100-sxm", 1024, 2),
    ("1b optim-in-backward", "llama-3.2-1b", dict(BF16, optimizer_in_backward=True), "rtx-4090", 1024, 2),
    ("1b lora", "llama-3.2-1b", dict(BF16, lora="lora:16"), "a100", 1024, 2),
    ("qwen0.5b bf16", "qwen2.5-0.5b", BF16, "rtx-4090", 1024, 2),
    ("qwen1.5b qlora ckpt", "qwen2.5-1.5b", dict(BF16, lora="qlora:16", checkpointing="blocks"), "h100-sxm", 1024, 2),
    ("qwen0.5b accum 2x2", "qwen2.5-0.5b", dict(BF16, micro_batch_size=2, grad_accum_steps=2), "a100", 1024, 1),
    ("gemma2-2b ckpt", "gemma-2-2b", dict(BF16, checkpointing="blocks"), "rtx-4090", 512, 2),
    ("gemma2-2b lora", "gemma-2-2b", dict(BF16, lora="lora:16"), "a100", 512, 2),
    ("phi3 ckpt", "phi-3-mini", dict(BF16, checkpointing="blocks"), "h100-sxm", 512, 2),
    ("phi3 qlora", "phi-3-mini", dict(BF16, lora="qlora:16"), "rtx-4090", 512, 2),
    ("gpt2 fp32", "gpt2", {}, "rtx-4090", 1024, 2),
    ("gpt2-medium every-2nd", "gpt2-medium", dict(BF16, checkpointing="blocks:2"), "a100", 1024, 2),
    ("mistral qlora accum", "mistral-7b",
     dict(BF16, lora="qlora:16", checkpointing="blocks", chunked_loss=4, micro_batch_size=2, grad_accum_steps=2),
     "rtx-4090", 1024, 1),
    ("8b lora ckpt", "llama-3.1-8b", dict(BF16, lora="lora:16", checkpointing="blocks"), "h100-sxm", 1024, 1),
    ("3b offload ckpt", "llama-3.2-3b", dict(BF16, offload_activations=True, checkpointing="blocks"), "a100", 1024, 2),
    ("qwen0.5b cpu", "qwen2.5-0.5b", BF16, None, 256, 2),
    ("gpt2 cpu", "gpt2", {}, None, 256, 2),
    # one rank of FSDP2 (gpus / nodes: the cluster, batch over all ranks): a block is a unit
    ("fsdp 8b x8 bf16:fp32 ckpt", "llama-3.1-8b", dict(FSDP, mixed_precision="bf16:fp32", checkpointing="blocks",
                                                        gpus=8), "h100-sxm", 2048, 8),
    ("fsdp 8b 8 nodes x8", "llama-3.1-8b", dict(FSDP, mixed_precision="bf16:fp32", gpus=8, nodes=8), "h100-sxm",
     2048, 64),
    ("fsdp mistral-7b x8 zero2", "mistral-7b", dict(FSDP, reshard_after_forward="false", gpus=8), "h100-sxm",
     2048, 8),
    ("fsdp 13b 2 nodes x8 world", "llama-2-13b", dict(FSDP, shard_over="world", gpus=8, nodes=2), "a100-80gb",
     2048, 16),
    ("fsdp 70b x8", "llama-3.1-70b", dict(FSDP, gpus=8), "h100-sxm", 2048, 8),
    ("fsdp 70b x8 bf16:fp32 ckpt", "llama-3.1-70b", dict(FSDP, mixed_precision="bf16:fp32", checkpointing="blocks",
                                                          gpus=8), "h100-sxm", 2048, 8),
    ("fsdp 70b 2 nodes x8 hsdp", "llama-3.1-70b", dict(FSDP, mixed_precision="bf16:fp32", checkpointing="blocks",
                                                        gpus=8, nodes=2), "h100-sxm", 2048, 16),
    ("fsdp 70b 8 nodes x8 world", "llama-3.1-70b", dict(FSDP, mixed_precision="bf16:fp32", checkpointing="blocks",
                                                         shard_over="world", gpus=8, nodes=8), "h100-sxm", 2048, 64),
    # every pipeline stage (1F1B, each stage FSDP2 x TP with sequence and loss parallel, the bf16 policy, every block
    # checkpointed): a stage is a shallow copy of its own blocks, written out at the stage's depth
    ("pp 8b 4 stages x tp2 x dp2", "llama-3.1-8b", dict(FSDP, mixed_precision="bf16:fp32", checkpointing="blocks",
                                                         tp=2, sequence_parallel=True, loss_parallel=True, pp=4,
                                                         micro_batch_size=1, grad_accum_steps=4, gpus=8, nodes=2),
     "h100-sxm", 2048, 8),
    # torchtitan's Table 6, first row (benchmarks/llama3_h100_202412_torchtitan.md): FSDP 8 x TP 8 x PP 8, seq 32768
    ("pp 405b 8 stages x tp8 x dp8", "llama-3.1-405b", dict(FSDP, mixed_precision="bf16:fp32", checkpointing="blocks",
                                                             tp=8, sequence_parallel=True, loss_parallel=True, pp=8,
                                                             shard_over="world", micro_batch_size=1, grad_accum_steps=8,
                                                             gpus=8, nodes=64), "h200", 32768, 64),
]


def _figures(report) -> dict:
    return {"allocated": report.peak_bytes, "reserved": report.reserved_bytes, "device_bytes": report.device_bytes}


def _ranks(report) -> list:
    return [{"rank": r["rank"], "allocated": r["peak_bytes"], "device_bytes": r.get("device_bytes")}
            for r in report.ranks or []]


def _relative(fast, full):
    return None if fast is None or full is None else (fast - full) / full


def run(case) -> dict:
    name, model, fields, gpu, seq_len, batch_size = case
    fields = dict(fields)
    world = {k: fields.pop(k) for k in ("gpus", "nodes") if k in fields}
    kwargs = dict(seq_len=seq_len, batch_size=batch_size, recipe=Recipe(**fields), **world)
    if gpu is not None:
        kwargs["gpu"] = gpu
    times, figures, notes, ranks = {}, {}, [], {}
    for label, fast in (("fast", True), ("full", False)):
        start = time.perf_counter()
        report = memfit.estimate(model, fast=fast, **kwargs)
        times[label] = round(time.perf_counter() - start, 1)
        figures[label] = _figures(report)
        ranks[label] = _ranks(report)
        if fast:
            notes = [n for n in report.notes if "counterpart" in n]
    row = {"case": name, "model": model, "recipe": Recipe(**fields).describe(), "gpu": gpu or "cpu", **world,
           "seq_len": seq_len, "batch_size": batch_size, "fast": figures["fast"], "full": figures["full"],
           "relative": {k: _relative(figures["fast"][k], figures["full"][k]) for k in figures["full"]},
           "fast_seconds": times["fast"], "full_seconds": times["full"], "notes": notes}
    if len(ranks["full"]) > 1:  # every traced rank: the largest difference of any
        row["ranks"] = {"fast": ranks["fast"], "full": ranks["full"]}
        row["relative"]["worst_rank"] = max(
            (abs(_relative(a[k], b[k])) for a, b in zip(ranks["fast"], ranks["full"]) for k in ("allocated", "device_bytes")
             if a[k] is not None and b[k] is not None), default=None)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run only cases whose name contains this")
    args = parser.parse_args()
    old = _results.read(RESULTS) if _results.path(RESULTS).exists() else {"rows": []}
    rows = {row["case"]: row for row in old["rows"]}
    for case in CASES:
        if args.only not in case[0]:
            continue
        row = run(case)
        rows[row["case"]] = row
        worst = max(abs(v) for v in row["relative"].values() if v is not None)
        print(f"{row['case']:24s} fast {row['fast']['device_bytes'] / 2**30:7.2f} GiB  full "
              f"{row['full']['device_bytes'] / 2**30:7.2f} GiB  worst {worst:+.3%}  "
              f"{row['fast_seconds']:6.1f} s vs {row['full_seconds']:6.1f} s", flush=True)
        _write(rows)


def _write(rows) -> None:
    order = [c[0] for c in CASES]
    cases = sorted(rows.values(), key=lambda r: order.index(r["case"]) if r["case"] in order else len(order))
    _results.write(RESULTS, cases)


if __name__ == "__main__":
    main()
