"""device_map placement of catalog models: each GPU's peak, the host RAM, and how long the estimate takes.

    python -m bench device_map      # prints the table, writes bench/results/device-map-cpu.json

Each case is ``memfit estimate MODEL --device-map ... --max-memory ...`` on this CPU (CUDA semantics
of the named card). A placement that keeps the whole model on one GPU runs the plain step (the
depth fast path); a split one is traced in full. A case that memfit refuses (as transformers or
Accelerate would refuse to run it) is recorded with its one-line reason. These figures are
estimates; the GPU check against ``max_memory_allocated`` is pending (no GPU in this session).
"""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import memfit  # noqa: E402
from memfit.errors import MemfitError  # noqa: E402
from memfit.units import format_size  # noqa: E402
from bench import _results  # noqa: E402

RESULTS = "device-map-cpu.json"
SEED_QLORA = {"lora": "qlora:16", "lora_alpha": 32, "lora_dropout": 0.05, "precision": "bf16-mixed",
              "checkpointing": "blocks", "optimizer": "paged_adamw8bit", "micro_batch_size": 1,
              "grad_accum_steps": 16}
CASES = [  # (what, model, gpu, seq_len, recipe, device_map, max_memory, gpus)
    ("seed 004 'maximum optimization': Llama-2-70B QLoRA on one A100-80GB", "llama-2-70b", "a100-80gb", 2048,
     SEED_QLORA, "auto", "0=70GB,cpu=100GB", None),
    ("seed 004 CPU offloading: Llama-2-70B QLoRA, 40GB GPU budget", "llama-2-70b", "a100-80gb", 2048,
     SEED_QLORA, "auto", "0=40GB,cpu=100GB", None),
    ("Llama-2-70B LoRA r16 in bf16 over 2 x A100-80GB", "llama-2-70b", "a100-80gb", 2048,
     {"lora": "lora:16", "precision": "bf16", "checkpointing": "blocks"}, "auto", None, 2),
    ("Llama-3.1-8B LoRA r16 in bf16 over 2 x RTX 4090, balanced", "llama-3.1-8b", "rtx-4090", 2048,
     {"lora": "lora:16", "precision": "bf16"}, "balanced", None, 2),
    ("Llama-3.1-8B full AdamW over 4 x RTX 4090", "llama-3.1-8b", "rtx-4090", 2048,
     {"precision": "bf16-mixed", "checkpointing": "blocks"}, "auto", "0=22GiB,1=22GiB,2=22GiB,3=22GiB,cpu=200GB",
     None),
]


def main() -> None:
    rows = []
    for what, model, gpu, seq_len, recipe, device_map, max_memory, gpus in CASES:
        start = time.perf_counter()
        row = {"case": what, "model": model, "gpu": gpu, "seq_len": seq_len, "recipe": recipe,
               "device_map": device_map, "max_memory": max_memory, "gpus": gpus}
        try:
            report = memfit.estimate(model, seq_len=seq_len, gpu=gpu, recipe=memfit.Recipe(**recipe),
                                     device_map=device_map, max_memory=max_memory, gpus=gpus)
        except MemfitError as err:
            row.update(refused=str(err), seconds=round(time.perf_counter() - start, 1))
            print(f"{what}: refused: {err}")
            rows.append(row)
            continue
        row.update(seconds=round(time.perf_counter() - start, 1), method=report.method,
                   entries=report.device_map["entries"], reported=report.device_map["reported"],
                   devices=[{k: r.get(k) for k in ("device", "peak_bytes", "reserved_bytes", "device_bytes", "verdict",
                                                        "missing_bytes")}
                            | {"parameter_bytes": r["by_category"].get("parameters", 0)} for r in report.devices],
                   host_bytes=report.host_bytes)
        rows.append(row)
        print(f"{what}: {row['seconds']} s ({report.method})")
        for r in row["devices"]:
            need = r["device_bytes"]
            print(f"  {r['device']:>7}: parameters {format_size(r['parameter_bytes'])}, peak {format_size(r['peak_bytes'])}"
                  + (f", on the device {format_size(need)} ({r['verdict']})" if need is not None else ""))
    print(f"wrote {_results.write(RESULTS, rows)}")


if __name__ == "__main__":
    main()
