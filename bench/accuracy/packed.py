"""What packing and padding cost: catalog models, dense vs padded vs packed micro-batches, and the
CPU allocator on the zoo's tiny Llama and GPT-2.

    python -m bench packed          # writes bench/results/packed.json

Catalog rows (estimates only, CUDA semantics of the card, depth fast path): the same micro-batch
shape (rows x seq) as a dense batch, padded with at least one padding token, and packed with
per-document attention; the difference is transformers' 4-D mask (bool, once per forward) and the
additive mask SDPA makes of it in every attention call, saved for backward (memory-efficient kernel
on CUDA, flash on the CPU). Then a length distribution (``LENGTHS``: a fixed-seed log-normal sample
of 2,000 documents, median ~600 tokens, truncated at seq) batched both ways: padded needs more rows'
worth of micro-batches for the same tokens; packed's worst micro-batch is always rows x seq.

CPU rows: the worst micro-batch of ``SHORT`` (``LENGTHS`` / 8: the tiny models have 128 positions) estimated, and the same micro-batch run for real
(batches built by hand, not by memfit), its peak read from the CPU allocator (``memfit.truth``).
"""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import memfit  # noqa: E402
from memfit import Recipe  # noqa: E402
from memfit.estimator.estimate import estimate_micro_batch  # noqa: E402
from memfit.estimator.truth import true_peak  # noqa: E402
from memfit.models.lengths import micro_batches  # noqa: E402
from memfit.models.zoo import hf  # noqa: E402
from bench import _results  # noqa: E402

RESULTS = "packed.json"
LENGTHS = [int(n) for n in np.random.default_rng(0).lognormal(6.4, 0.9, 2000).clip(8, None)]
CATALOG = [
    ("llama-3.2-1b", "h100-sxm", 4, 2048, Recipe(precision="bf16-mixed")),
    ("llama-3.2-1b", "h100-sxm", 4, 2048, Recipe(precision="bf16-mixed", checkpointing="blocks")),
    ("llama-3.2-1b", "h100-sxm", 1, 8192, Recipe(precision="bf16-mixed", checkpointing="blocks", chunked_loss=8)),
    ("llama-3.1-8b", "h100-sxm", 2, 4096, Recipe(precision="bf16-mixed", checkpointing="blocks", chunked_loss=8,
                                                 lora="lora:16")),
]
# the tiny zoo models have 128 positions: the same distribution, an eighth as long
SHORT = [max(1, n // 8) for n in LENGTHS[:400]]


def _catalog(model, gpu, rows, seq, recipe) -> dict:
    out = {"model": model, "gpu": gpu, "rows": rows, "seq": seq, "recipe": recipe.to_dict()}
    for kind, kwargs in (("dense", {"ragged": False}), ("padded", {}), ("packed", {"packed": True})):
        start = time.time()
        report = estimate_micro_batch(model, rows, seq, gpu=gpu, recipe=recipe, **kwargs)
        out[kind] = {"allocated": report.peak_bytes, "reserved": report.reserved_bytes,
                     "forward": report.phase_peaks["forward"], "backward": report.phase_peaks["backward"],
                     "device": report.device_bytes, "seconds": round(time.time() - start, 1)}
    tokens = {"padded": _tokens(rows, seq, False), "packed": _tokens(rows, seq, True)}
    out["lengths"] = {"documents": len(LENGTHS), "tokens": sum(min(n, seq) for n in LENGTHS), **tokens}
    return out


def _tokens(rows, seq, packed) -> dict:
    batches = micro_batches(LENGTHS, rows, packed=packed, seq_len=seq)
    slots = sum(mb.rows * mb.length for mb in batches)
    real = sum(mb.tokens for mb in batches)
    return {"micro_batches": len(batches), "token_slots": slots, "real_share": round(real / slots, 4)}


def _cpu(kind) -> dict:
    factory, config = hf(kind)
    seq, rows, recipe = 128, 2, Recipe(optimizer="sgd")
    out = {"model": f"zoo hf-{kind}", "rows": rows, "seq": seq}
    for packed in (False, True):
        report = memfit.estimate(config, lengths=SHORT, packed=packed, batch_size=rows, seq_len=seq, recipe=recipe)
        mb = report.micro_batch
        worst = micro_batches(SHORT, rows, packed=packed, seq_len=seq)[mb["index"]]
        batch = _real_batch(worst.docs, mb["length"], packed)
        truth = true_peak(factory, batch, recipe=recipe)
        out["packed" if packed else "padded"] = {"micro_batch": mb, "estimate": report.peak_bytes, "allocator": truth,
                                                 "error_bytes": report.peak_bytes - truth}
    return out


def _real_batch(docs, length, packed) -> dict:
    ids = torch.randint(1, 512, (len(docs), length), generator=torch.Generator().manual_seed(0))
    if packed:
        rows = []
        for row in docs:
            pos = torch.cat([torch.arange(n) for n in row])
            rows.append(torch.cat([pos, torch.arange(pos[-1] + 1, pos[-1] + 1 + length - len(pos))]))
        return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.stack(rows), "use_cache": False}
    mask = torch.stack([(torch.arange(length) < row[0]).long() for row in docs])
    return {"input_ids": ids, "labels": ids.masked_fill(mask == 0, -100), "attention_mask": mask}


def main() -> None:
    rows = [_catalog(*case) for case in CATALOG]
    cpu = [_cpu(kind) for kind in ("llama", "gpt2")]
    path = _results.write(RESULTS, _results.tables(catalog=rows, cpu=cpu))
    print(path.read_text())


if __name__ == "__main__":
    main()
