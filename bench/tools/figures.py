"""A snapshot of memfit's figures, to show a refactor changed none of them.

    python -m bench figures snapshot OUT.json      # estimates, plans and fits through the public API
    python -m bench figures compare A.json B.json  # every figure equal, or the ones that differ

Only the public API (``memfit.estimate``, ``memfit.plan``, ``memfit.fit``) is called, so the same
script runs on the tree before and after a move. Timings (``seconds``, ``estimate_seconds``) and the
host's measured speed are left out: they are not figures of the model. The cases cover the zoo's
eight models under every precision on the CPU, each technique alone and the demo's combination
under CUDA semantics, the depth fast path against a full trace, a GPU plan sweep and a fit.
"""

from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file

# Wall-clock figures vary run to run; so does the timeline (live bytes after each event, sampled)
# of CPU mixed-precision steps at events away from the peak: the oneDNN kernel scratch replayed
# there differs between two runs of the same tree in one process (measured: mlp bf16-mixed, event
# 32: 7,906,372 / 7,908,400 / 8,428,612 / 8,430,640 bytes), while every peak stays the same.
NOISE = {"seconds", "estimate_seconds", "speed", "timeline"}
RESULTS = None  # a snapshot where the command says, compared with another: not kept in bench/results/


def _clean(value):
    # a field that is None (a figure the case does not have, such as managed_bytes without a paged
    # optimizer) compares equal to the field missing: a snapshot from before the field existed
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items() if k not in NOISE and v is not None}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _llama(layers=2):
    import transformers as tf

    return tf.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
                          architectures=["LlamaForCausalLM"])


RECIPES = [  # each technique alone, then together (the demo's shape of recipe)
    {}, {"precision": "bf16-mixed"}, {"precision": "fp16-mixed"}, {"checkpointing": "blocks"},
    {"checkpointing": "selective"}, {"checkpointing": "blocks:2"}, {"offload_activations": True},
    {"attention": "eager"}, {"chunked_loss": 4}, {"optimizer": "sgd"}, {"optimizer": "adafactor"},
    {"optimizer_in_backward": True}, {"micro_batch_size": 2, "grad_accum_steps": 2}, {"lora": "lora:8"},
    {"optimizer": "adamw8bit"}, {"precision": "bf16"},
    {"precision": "bf16-mixed", "checkpointing": "blocks", "chunked_loss": 4, "micro_batch_size": 2,
     "grad_accum_steps": 2, "lora": "qlora:8"},
]


def snapshot(out: str) -> None:
    import memfit
    from memfit.models.zoo import CASES

    figures, start = {}, time.perf_counter()

    def record(key, fn):
        try:
            figures[key] = _clean(fn().to_dict())
        except memfit.MemfitError as err:
            figures[key] = {"error": str(err)}
        print(f"{time.perf_counter() - start:7.1f}s {key}", flush=True)

    for name, (factory, make_batch, loss_fn) in CASES.items():
        for precision in ("fp32", "bf16-mixed", "fp16-mixed"):
            if name == "lstm" and precision == "fp16-mixed":
                continue
            record(f"zoo/{name}/{precision}", lambda: memfit.estimate(factory, make_batch(), loss_fn=loss_fn,
                                                                    precision=precision))
    config = _llama(4)
    for recipe in RECIPES:
        r = memfit.Recipe(**recipe)
        for device, gpu in (("cpu", None), ("cuda", "rtx-4090")):
            record(f"llama4/{device}/{r.describe()}", lambda: memfit.estimate(
                config, recipe=r, batch_size=4, seq_len=64, device=device, gpu=gpu))
    deep = _llama(12)
    for fast in (True, False):
        for recipe in ({}, {"precision": "bf16-mixed", "checkpointing": "blocks"}):
            r = memfit.Recipe(**recipe)
            record(f"llama12/fast={fast}/{r.describe()}", lambda: memfit.estimate(
                deep, recipe=r, batch_size=2, seq_len=64, gpu="rtx-4090", fast=fast))
    record("llama4/budget", lambda: memfit.estimate(config, batch_size=8, seq_len=128, gpu="rtx-4090",
                                                    budget="24MiB"))
    context = memfit.estimate(config, gpu="rtx-4090", seq_len=8).context_bytes
    # the sweep shares its traces (the counts in plans' settings say so): through a cache the caller
    # owns where plan takes one, else (older trees) the planner's own
    try:
        from memfit.planner.cache import EngineCache

        shared = {"cache": EngineCache()}
    except ImportError:
        shared = {}
    for mib in (40, 64, 160):
        record(f"plan/{mib}MiB", lambda: memfit.plan(_llama(2), gpu="rtx-4090", budget=context + mib * 2**20,
                                                     global_batch_size=8, seq_len=128, **shared))
    record("plan/allow", lambda: memfit.plan(_llama(2), gpu="rtx-4090", budget=context + 160 * 2**20,
                                             global_batch_size=8, seq_len=128, allow="lora,adamw8bit", **shared))
    record("fit/rtx-4090", lambda: memfit.fit(_llama(4), gpu="rtx-4090", budget=context + 200 * 2**20, seq_len=128,
                                              **shared))
    with open(out, "w") as f:
        json.dump(figures, f, indent=1, sort_keys=True)
    print(f"{len(figures)} cases in {time.perf_counter() - start:.0f} s -> {out}")


def compare(a: str, b: str) -> int:
    with open(a) as f:
        before = _clean(json.load(f))
    with open(b) as f:
        after = _clean(json.load(f))
    differ = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    for key in differ:
        print(f"differs: {key}")
        x, y = before.get(key, {}), after.get(key, {})
        for field in sorted(set(x) | set(y)):
            if x.get(field) != y.get(field):
                print(f"  {field}: {str(x.get(field))[:200]} -> {str(y.get(field))[:200]}")
    print(f"{len(before)} cases before, {len(after)} after, {len(differ)} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "snapshot":
        snapshot(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
