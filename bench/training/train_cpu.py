"""memfit.train on the CPU: token-budget micro-batches against fixed rows, and the trainer's own cost.

    python -m bench train_cpu

1. A long-tailed variable-length dataset (Pareto lengths, 16..1024 tokens) under a virtual budget
   sized so 4 rows of the longest sequence fit: fixed-row micro-batches (4 rows in data order,
   padded to their longest, as a plain loop sized for the worst case) against micro-batches formed
   by their predicted bytes (rows sorted by length, as many of a length as memfit's estimate of that
   shape says fit the budget: ``training/predict.py``). Tokens/s counts real tokens and excludes the
   one-time estimates (reported apart); both must stay under the budget, and each step's measured
   peak is compared with the estimate of its largest micro-batch shape.
2. The trainer's step time against a hand-written loop running the same micro-batches and recipe
   (forward, token-weighted backward, AdamW step, zero_grad), no budget: the trainer with the plain
   step (``chunks=None``, as the hand loop) and with its default chunked ``SafeStep`` (8 chunks).

Results: bench/results/train-cpu.json.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # this tree's memfit; bench/ a package when run as a file

from memfit import Recipe  # noqa: E402
from memfit.techniques.step import token_weights  # noqa: E402
from memfit.training.batching import micro_batches  # noqa: E402
from memfit.training.data import Order, collate  # noqa: E402
from memfit.training.loop import train  # noqa: E402
from bench import _results  # noqa: E402

RESULTS = "train-cpu.json"
LONGEST, ROWS, GLOBAL, STEPS = 1024, 4, 32, 12
TIMED = 12  # steps for the overhead comparison (the first is not counted)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=512, seed=0):
        rng = random.Random(seed)
        lengths = [max(16, min(LONGEST, int(rng.paretovariate(1.1) * 24))) for _ in range(n)]
        lengths[0] = LONGEST  # the worst case is in the data
        self.ids = [torch.randint(1, 256, (n_,), generator=torch.Generator().manual_seed(i))
                    for i, n_ in enumerate(lengths)]
        self.lengths = np.array(lengths)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i]}


def model():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=LONGEST)
    return tf.LlamaForCausalLM(cfg)


def run(batching: str, budget, out, steps: int = STEPS, **kw) -> dict:
    data = Tokens()
    result = train(model(), data, recipe=Recipe(micro_batch_size=ROWS), global_batch_size=GLOBAL, steps=steps,
                   seq_len=LONGEST, budget=budget, batching=batching, out_dir=out, progress=False, seed=0,
                   checkpoint_every=10**6, **kw)
    lines = [json.loads(x) for x in open(Path(out) / "metrics.jsonl")]
    steady = lines[1:]  # the first step pays one-time costs
    tokens = sum(x["tokens"] for x in steady)
    seconds = sum(x["seconds"] for x in steady)
    res = {"batching": batching, "tokens_per_second": tokens / seconds, "peak_bytes": result.peak_bytes,
           "ooms": len(result.ooms), "seconds_per_step": seconds / len(steady),
           "micro_batches_per_step": sum(x["micro_batches"] for x in lines) / len(lines),
           "estimate_seconds": sum(x["estimate_seconds"] for x in lines)}
    if lines[0]["predicted"] is not None:  # measured peak of each step / the estimate of its largest shape
        ratios = [x["memory_peak"] / x["predicted"] for x in lines]
        res.update(predicted_peak_bytes=max(x["predicted"] for x in lines),
                   measured_over_predicted=[round(min(ratios), 4), round(max(ratios), 4)])
    return res


def hand_loop(out) -> float:
    """The same global batches and micro-batches as the trainer, in a plain loop: seconds per step."""
    data, m = Tokens(), model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    order = Order(len(data), seed=0)
    cap = ROWS * LONGEST
    times = []
    for step in range(TIMED):
        ids = order.take(GLOBAL)
        start = time.perf_counter()
        groups = micro_batches([int(data.lengths[i]) for i in ids], lambda r, n: r == 1 or r * n <= cap)
        micro = [collate([data[ids[i]] for row in g for i in row]) for g in groups]
        weights = token_weights(m, micro) if len(micro) > 1 else [None]
        for part, w in zip(micro, weights):
            loss = m(**part).loss
            (loss * w if w is not None else loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return sum(times[1:]) / len(times[1:])


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    probe = run("rows", "8GiB", tmp / "probe")  # the fixed-row loop's own peak: the budget is set by it
    budget = int(probe["peak_bytes"] * 1.05)
    rows = run("rows", budget, tmp / "rows")
    tokens = run("tokens", budget, tmp / "tokens")
    hand = hand_loop(tmp / "hand")
    plain = run("tokens", None, tmp / "plain", steps=TIMED, chunks=None)
    trainer = run("tokens", None, tmp / "free", steps=TIMED)
    hand = min(hand, hand_loop(tmp / "hand2"))  # the faster of two: the machine is shared
    shutil.rmtree(tmp, ignore_errors=True)
    summary = {
        "speedup": tokens["tokens_per_second"] / rows["tokens_per_second"],
        "hand_loop_seconds_per_step": hand, "trainer_plain_step_seconds_per_step": plain["seconds_per_step"],
        "trainer_overhead": plain["seconds_per_step"] / hand - 1,
        "trainer_safe_step_seconds_per_step": trainer["seconds_per_step"],
        "safe_step_overhead": trainer["seconds_per_step"] / plain["seconds_per_step"] - 1,
    }
    print(_results.write(RESULTS, [rows, tokens], summary, budget_bytes=budget).read_text())


if __name__ == "__main__":
    main()
