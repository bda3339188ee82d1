"""Per-rank estimates of data-parallel steps against real ``torchrun`` runs on this CPU (gloo).

Each case runs for real under ``torchrun --nproc_per_node N`` (``memfit.distributed.truth``: every
rank's peak from its own CPU allocator events) and is estimated by ``memfit.estimate(..., gpus=N)``
under PyTorch's fake process group. Prints one row per case and rank and writes
``bench/results/distributed-cpu.json``.

    python -m bench distributed [--only NAME ...]          # --only: those cases' rows replaced, the others kept
    python -m bench distributed --only tp-2 ... --out distributed-tp-cpu.json   # a bare name: in bench/results/
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
os.environ.setdefault("MEMFIT_DEVICE", "cpu")  # graded by torchrun on gloo: CPU semantics (the default is CUDA)


import memfit
from memfit.distributed.truth import launch
from memfit.techniques.recipe import Recipe
from bench import _results

RESULTS = ("distributed-cpu.json", "distributed-<parallelism>-cpu.json")

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
        "intermediate_size": 352, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
BERT = {"architectures": ["BertForMaskedLM"], "model_type": "bert", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 1000, "max_position_embeddings": 128}
UNEVEN = dict(TINY, vocab_size=1001, tie_word_embeddings=False, intermediate_size=350)
PIPE = dict(TINY, num_hidden_layers=6)  # 4 stages: embedding + 1 block, 2, 2, 1 block + norm + head
WIDE = dict(TINY, hidden_size=1024, intermediate_size=4096, num_hidden_layers=6, num_attention_heads=8,
            num_key_value_heads=8, vocab_size=1024, tie_word_embeddings=False)
DEEP = dict(TINY, num_hidden_layers=16)  # the whole model outweighs a step of 1/4 of it: construction shows
# mixtures of experts for expert parallel (``techniques/expert_parallel.py``): 4 experts, top-2
QWEN_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
            "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 256,
            "max_position_embeddings": 512}
MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
           "num_experts_per_tok": 2, "vocab_size": 256, "max_position_embeddings": 512}
#: the routing a case's routers follow (``expert_parallel.route``) and its estimate assumes; balanced otherwise
ROUTING = {"ep-2-worst": "worst", "ep-4-bf16-checkpointing-worst": "worst"}

# (name, config, ranks, recipe, batch over all ranks, nodes)
CASES = [
    ("fsdp", TINY, 2, {"parallel": "fsdp"}, 4, 1),
    ("fsdp-zero2", TINY, 2, {"parallel": "fsdp", "reshard_after_forward": "false"}, 4, 1),
    ("ddp", TINY, 2, {"parallel": "ddp"}, 4, 1),
    ("fsdp-bf16-policy", TINY, 2, {"parallel": "fsdp", "mixed_precision": "bf16:fp32"}, 4, 1),
    ("fsdp-autocast", TINY, 2, {"parallel": "fsdp", "precision": "bf16-mixed"}, 4, 1),
    # accelerate's (and the Trainer's) FSDP2 with mixed_precision bf16: autocast over a bf16 policy
    ("fsdp-autocast-bf16-policy", TINY, 2, {"parallel": "fsdp", "precision": "bf16-mixed", "mixed_precision": "bf16"},
     4, 1),
    ("fsdp-checkpointing", TINY, 2, {"parallel": "fsdp", "checkpointing": "blocks"}, 4, 1),
    ("fsdp-accumulation", TINY, 2, {"parallel": "fsdp", "micro_batch_size": 1, "grad_accum_steps": 2}, 4, 1),
    ("ddp-accumulation", TINY, 2, {"parallel": "ddp", "micro_batch_size": 1, "grad_accum_steps": 2}, 4, 1),
    ("fsdp-lora", TINY, 2, {"parallel": "fsdp", "lora": "lora:8"}, 4, 1),
    ("fsdp-offload", TINY, 2, {"parallel": "fsdp", "offload": "cpu-unpinned"}, 4, 1),
    ("fsdp-offload-1", TINY, 1, {"parallel": "fsdp", "offload": "cpu-unpinned"}, 2, 1),
    ("fsdp-uneven", UNEVEN, 2, {"parallel": "fsdp"}, 4, 1),
    # torchtune's custom_sharded_layers: the untied embedding and head units of their own (its 70B full fine-tune)
    ("fsdp-shard-modules", UNEVEN, 2, {"parallel": "fsdp", "shard_modules": "embed_tokens,lm_head"}, 4, 1),
    # compile=layers: each block compiled by Inductor (really, in the truth), then FSDP2-sharded
    ("fsdp-compile-layers", DEEP, 2, {"parallel": "fsdp", "compile": "layers", "precision": "bf16-mixed"}, 4, 1),
    ("fsdp-compile-layers-checkpointing-lora-shard-modules", UNEVEN, 2,
     {"parallel": "fsdp", "compile": "layers", "checkpointing": "blocks", "precision": "bf16", "lora": "lora:8",
      "shard_modules": "embed_tokens,lm_head"}, 4, 1),
    # wide blocks, small root: the peak is in forward, at a gathered layer beside two all-gather buffers (the 70B
    # LoRA row's peak, bench/published)
    ("fsdp-lora-wide-blocks", WIDE, 2, {"parallel": "fsdp", "precision": "bf16", "lora": "lora:8",
                                        "checkpointing": "blocks"}, 4, 1),
    # torchtune's distributed QLoRA: torchao's NF4 weights sharded and gathered through their own FSDP2 hooks
    ("fsdp-qlora-nf4-wide-blocks", WIDE, 2, {"parallel": "fsdp", "precision": "bf16", "lora": "qlora:8",
                                             "quant_impl": "torchao", "lora_dtype": "bf16", "checkpointing": "blocks"},
     4, 1),
    ("fsdp-qlora-nf4-4", WIDE, 4, {"parallel": "fsdp", "precision": "bf16-mixed", "lora": "qlora:8",
                                   "quant_impl": "torchao"}, 4, 1),
    ("fsdp-shard-modules-offload-checkpointing", UNEVEN, 4, {"parallel": "fsdp", "shard_modules": "embed_tokens,lm_head",
                                                            "offload": "cpu-unpinned", "checkpointing": "blocks"}, 4, 1),
    ("fsdp-bert-tied", BERT, 2, {"parallel": "fsdp"}, 4, 1),
    ("fsdp-4", TINY, 4, {"parallel": "fsdp"}, 4, 1),
    ("fsdp-uneven-4", UNEVEN, 4, {"parallel": "fsdp"}, 4, 1),
    ("hsdp-2x2", TINY, 4, {"parallel": "fsdp"}, 4, 2),
    ("fsdp-over-2-nodes", TINY, 4, {"parallel": "fsdp", "shard_over": "world"}, 4, 2),
    ("fsdp-partial-reshard-4", TINY, 4, {"parallel": "fsdp", "reshard_after_forward": "2"}, 4, 1),
    ("fsdp-built-on-device-4", DEEP, 4, {"parallel": "fsdp", "construction": "device", "optimizer": "sgd"}, 4, 1),
    # tensor parallel (``techniques/tensor_parallel.py``); TP peers read the same rows
    ("tp-2", TINY, 2, {"tp": 2}, 2, 1),
    ("tp-2-autocast", TINY, 2, {"tp": 2, "precision": "bf16-mixed"}, 2, 1),
    ("fsdp-tp-2x2", TINY, 4, {"tp": 2, "parallel": "fsdp"}, 4, 1),
    ("fsdp-tp-2x2-bf16-checkpointing", TINY, 4, {"tp": 2, "parallel": "fsdp", "mixed_precision": "bf16",
                                                 "checkpointing": "blocks"}, 4, 1),
    # sequence and loss parallel (torchtitan's layout over the model's plan)
    ("tp-2-sequence-loss", TINY, 2, {"tp": 2, "sequence_parallel": True, "loss_parallel": True}, 2, 1),
    ("tp-2-sequence-loss-autocast", TINY, 2, {"tp": 2, "sequence_parallel": True, "loss_parallel": True,
                                              "precision": "bf16-mixed"}, 2, 1),
    ("fsdp-tp-2x2-sequence-loss-bf16-checkpointing", TINY, 4, {"tp": 2, "parallel": "fsdp", "mixed_precision": "bf16",
                                                              "checkpointing": "blocks", "sequence_parallel": True,
                                                              "loss_parallel": True}, 4, 1),
    # pipeline parallel (``techniques/pipeline_parallel.py``): every stage traced, 4 micro-batches a step
    ("pp-2-1f1b", PIPE, 2, {"pp": 2, "micro_batch_size": 1, "grad_accum_steps": 4}, 4, 1),
    ("pp-2-gpipe", PIPE, 2, {"pp": 2, "pp_schedule": "gpipe", "micro_batch_size": 1, "grad_accum_steps": 4}, 4, 1),
    ("pp-4-1f1b", PIPE, 4, {"pp": 4, "micro_batch_size": 1, "grad_accum_steps": 4}, 4, 1),
    ("pp-2-1f1b-autocast-checkpointing", PIPE, 2, {"pp": 2, "micro_batch_size": 1, "grad_accum_steps": 4,
                                                   "precision": "bf16-mixed", "checkpointing": "blocks"}, 4, 1),
    # FSDP2 shards each stage over its data-parallel ranks: the (pp, dp) mesh, 2 x 2
    ("pp-2-fsdp-2-1f1b", PIPE, 4, {"pp": 2, "parallel": "fsdp", "micro_batch_size": 1, "grad_accum_steps": 4}, 8, 1),
    # a stage a node, FSDP2 within it (pp outermost: the stages split the nodes)
    ("pp-2-over-2-nodes-fsdp-2", PIPE, 4, {"pp": 2, "parallel": "fsdp", "micro_batch_size": 1,
                                           "grad_accum_steps": 4}, 8, 2),
    # Interleaved 1F1B: two stages a rank (4 in all), each its own FSDP2 root; and with TP
    ("pp-2-interleaved-1f1b-fsdp-2", PIPE, 4, {"pp": 2, "pp_schedule": "interleaved-1f1b", "parallel": "fsdp",
                                               "micro_batch_size": 1, "grad_accum_steps": 4}, 8, 1),
    ("pp-2-interleaved-1f1b-tp-2-sequence-loss", PIPE, 4, {"pp": 2, "pp_schedule": "interleaved-1f1b", "tp": 2,
                                                           "sequence_parallel": True, "loss_parallel": True,
                                                           "micro_batch_size": 1, "grad_accum_steps": 4}, 4, 1),
    # PP x TP on one (pp, tp) mesh: sequence shards between stages, the last stage's loss on vocabulary shards
    ("pp-2-tp-2-sequence-loss", PIPE, 4, {"pp": 2, "tp": 2, "sequence_parallel": True, "loss_parallel": True,
                                          "micro_batch_size": 1, "grad_accum_steps": 4}, 4, 1),
    # the 3-D mesh of torchtitan's 405B row, in small: (pp, dp, tp) = 2 x 2 x 2
    ("pp-2-fsdp-2-tp-2-sequence-loss-bf16-checkpointing", PIPE, 8,
     {"pp": 2, "tp": 2, "parallel": "fsdp", "mixed_precision": "bf16", "checkpointing": "blocks",
      "sequence_parallel": True, "loss_parallel": True, "micro_batch_size": 1, "grad_accum_steps": 4}, 8, 1),
    # expert parallel (``techniques/expert_parallel.py``): the experts split over ep ranks of the FSDP2 group,
    # tokens moved by all-to-all, the routers made to choose as the estimate assumes (ROUTING)
    ("ep-2", QWEN_MOE, 2, {"parallel": "fsdp", "ep": 2}, 4, 1),
    ("ep-2-worst", QWEN_MOE, 2, {"parallel": "fsdp", "ep": 2}, 4, 1),
    ("ep-2-of-4", QWEN_MOE, 4, {"parallel": "fsdp", "ep": 2}, 4, 1),
    ("ep-4-bf16-checkpointing-worst", QWEN_MOE, 4, {"parallel": "fsdp", "ep": 4, "mixed_precision": "bf16",
                                                    "checkpointing": "blocks"}, 4, 1),
    ("ep-2-accumulation-autocast", QWEN_MOE, 2, {"parallel": "fsdp", "ep": 2, "precision": "bf16-mixed",
                                                  "micro_batch_size": 1, "grad_accum_steps": 2}, 4, 1),
    ("hsdp-2x2-ep-2", QWEN_MOE, 4, {"parallel": "fsdp", "ep": 2}, 4, 2),
    ("ep-2-mixtral", MIXTRAL, 2, {"parallel": "fsdp", "ep": 2}, 4, 1),
    # one expert a rank, two copies of it: FSDP2 shards the experts on dim 1 (torchtitan's placement)
    ("ep-2-of-4-dim1", dict(QWEN_MOE, num_experts=2, num_experts_per_tok=1), 4, {"parallel": "fsdp", "ep": 2}, 4, 1),
    # float8 training (``techniques/float8.py``): torchao's Float8Linear, emulated on the CPU, under FSDP2
    ("fsdp-float8-tensorwise", TINY, 2, {"parallel": "fsdp", "float8": "tensorwise"}, 4, 1),
    ("fsdp-float8-rowwise-bf16-policy", TINY, 2, {"parallel": "fsdp", "float8": "rowwise",
                                                  "mixed_precision": "bf16:fp32"}, 4, 1),
    # context parallel (``techniques/context_parallel.py``): torch's context_parallel, each row's sequence in 2 x cp
    # load-balanced chunks, ring attention over the cp ranks of the FSDP2 group
    ("cp-2", TINY, 2, {"parallel": "fsdp", "cp": 2}, 2, 1),
    ("cp-2-alltoall", TINY, 2, {"parallel": "fsdp", "cp": 2, "cp_rotate": "alltoall"}, 2, 1),
    ("cp-4-bf16-checkpointing", TINY, 4, {"parallel": "fsdp", "cp": 4, "mixed_precision": "bf16",
                                          "checkpointing": "blocks"}, 2, 1),
    ("cp-2-of-4-accumulation-autocast", TINY, 4, {"parallel": "fsdp", "cp": 2, "precision": "bf16-mixed",
                                                  "micro_batch_size": 1, "grad_accum_steps": 2}, 4, 1),
    ("hsdp-2x2-cp-2", TINY, 4, {"parallel": "fsdp", "cp": 2}, 4, 2),
]
SEQ = 64


def run_case(name, config, ranks, recipe, batch, nodes, folder) -> list[dict]:
    path = Path(folder, name, "config.json")
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(config))
    gpus = ranks // nodes
    routing = ROUTING.get(name, "balanced")
    case = {"model": str(path), "recipe": recipe, "batch_size": batch, "seq_len": SEQ, "steps": 2,
            "gpus_per_node": gpus, "moe_routing": routing}
    started = time.perf_counter()
    report = memfit.estimate(str(path), batch_size=batch, seq_len=SEQ, recipe=Recipe.from_dict(recipe), gpus=gpus,
                             nodes=nodes, moe_routing=routing)
    seconds = time.perf_counter() - started
    estimated = {r["rank"]: r["peak_bytes"] for r in report.ranks}
    rows = []
    truths = launch(case, ranks)
    most = max(t["peak_bytes"] for t in truths)
    for truth in truths:
        rank = truth["rank"]
        # ranks the estimate did not trace hold what rank 0 holds (full shards), or with a pipeline what the first
        # data-parallel rank of their stage holds
        dp = ranks // recipe.get("pp", 1)
        estimate = estimated.get(rank, estimated[rank - rank % dp] if recipe.get("pp", 1) > 1
                                 else estimated[0] if rank != ranks - 1 else estimated[max(estimated)])
        # built on the device: the truth's peak from before the model was built
        true = truth["peak_with_construction"] if recipe.get("construction") == "device" else truth["peak_bytes"]
        # worst routing: the estimate is the rank its experts' tokens all reach (EP rank 0); the ranks that only
        # send hold less, and are not what it claims
        # context parallel: the estimate traces the first and the last CP rank (the ring's two extremes); a rank
        # between them is claimed to hold no more than the higher of the two
        between = recipe.get("cp", 1) > 1 and rank not in estimated and rank % recipe["cp"] not in (0, recipe["cp"] - 1)
        if between:
            estimate = max(estimated.values())
        bound = (routing == "worst" and true < most) or (between and true <= estimate)
        error = None if bound else (estimate - true) / true
        row = {"case": name, "ranks": ranks, "nodes": nodes, "rank": rank, "recipe": recipe, "routing": routing,
               "true_bytes": true, "estimated_bytes": estimate, "error": error, "below_the_worst_rank": bound,
               "estimate_seconds": round(seconds, 2)}
        host = ""
        if report.host_bytes is not None and recipe.get("offload"):
            # the host side: the real run's peak during the last optimizer step, less what a GPU run
            # keeps on the device then (buffers and the batch)
            true_host = truth["phase_peaks"]["optimizer:1"] - truth["buffers_and_batch"]
            row.update(true_host_bytes=true_host, estimated_host_bytes=report.host_bytes,
                       host_error=(report.host_bytes - true_host) / true_host)
            host = f"  host true {true_host:,} estimate {report.host_bytes:,} {100 * row['host_error']:+.3f}%"
        rows.append(row)
        shown = ("(a CP rank between the traced two: below their higher)" if between and bound else
                 "(sends only: below the worst rank)" if bound else f"{100 * error:+.3f}%")
        print(f"{name:24} rank {rank}/{ranks}  true {true:>11,}  estimate {estimate:>11,}  {shown}{host}", flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="case names to run (their rows replaced in the results file)")
    parser.add_argument("--out", default=None, help="default bench/results/distributed-cpu.json")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name, config, ranks, recipe, batch, nodes in CASES:
            if args.only and name not in args.only:
                continue
            rows.extend(run_case(name, config, ranks, recipe, batch, nodes, folder))
    out = args.out or RESULTS[0]
    if args.only and _results.path(out).exists():  # the other cases' rows kept, in CASES' order
        ran, order = {r["case"] for r in rows}, {case[0]: i for i, case in enumerate(CASES)}
        kept = [r for r in _results.read(out)["rows"] if r["case"] not in ran and r["case"] in order]
        rows = sorted(kept + rows, key=lambda r: (order[r["case"]], r["rank"]))
    worst = max(abs(r["error"]) for r in rows if r["error"] is not None)
    print(f"{len(rows)} rank(s) of {len({r['case'] for r in rows})} case(s): worst |error| {100 * worst:.3f}%")
    _results.write(out, rows, {"worst_abs_error": worst}, device=f"{_results.device_name()}, gloo", seq_len=SEQ)
    return 0


if __name__ == "__main__":
    sys.exit(main())
