"""On a CUDA GPU: every technique's parity with the plain step, its peak and its speed.

    python -m bench cuda_checks --out DIR     # writes DIR/cuda-checks-<gpu>.json

The CUDA-only paths (pinned-memory activation offload, torchao's CPU-offloaded optimizer,
bitsandbytes' 8-bit AdamW on the GPU, fp16 with a dynamic scaler) cannot run in CI, so they are
exercised here: parameters after 3 steps against the plain run (max abs difference), peak
``max_memory_allocated`` and the time of the third step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file

import torch  # noqa: E402
import transformers as tf  # noqa: E402

from memfit import Recipe  # noqa: E402
from memfit.techniques.apply import apply  # noqa: E402
from bench import _results  # noqa: E402

RECIPES = {
    "plain": Recipe(),
    "checkpointing": Recipe(checkpointing="blocks"),
    "selective": Recipe(checkpointing="selective"),
    "offload_activations": Recipe(offload_activations=True),
    "checkpointing+offload": Recipe(checkpointing="blocks", offload_activations=True),
    "optimizer_in_backward": Recipe(optimizer_in_backward=True),
    "accumulation x4": Recipe(grad_accum_steps=4),
    "chunked_loss 8": Recipe(chunked_loss=8),
    "bf16-mixed": Recipe(precision="bf16-mixed"),
    "fp16-mixed": Recipe(precision="fp16-mixed"),
    "adamw8bit": Recipe(optimizer="adamw8bit"),
    "offload_optimizer": Recipe(offload_optimizer=True),
    "lora:16": Recipe(lora="lora:16"),
    "bf16-mixed+ckpt+chunked+inbwd": Recipe(precision="bf16-mixed", checkpointing="blocks", chunked_loss=8,
                                            optimizer_in_backward=True),
}
RESULTS = "cuda-checks-<card>.json"


def _model():
    cfg = tf.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                         num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
    return tf.LlamaForCausalLM(cfg)


def _batch():
    ids = torch.randint(0, 32000, (8, 1024), generator=torch.Generator().manual_seed(0)).cuda()
    return {"input_ids": ids, "labels": ids.clone()}


def _run(recipe, batch, steps=3):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = _model()
    model, _, step = apply(model, recipe)
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(batch)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    params = [p.detach().float().cpu() for p in model.parameters()]
    peak = torch.cuda.max_memory_allocated()
    skipped = getattr(step, "skipped", 0)
    del model, step
    return params, peak, seconds, skipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(_results.DIR))
    args = parser.parse_args()
    batch = _batch()
    tokens = batch["input_ids"].numel()
    reference, rows = None, {}
    for name, recipe in RECIPES.items():
        try:
            params, peak, seconds, skipped = _run(recipe, batch)
        except Exception as err:  # recorded, not fatal: one missing library must not lose the rest
            rows[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:240]}"}
            print(f"{name:32} ERROR {rows[name]['error']}", flush=True)
            continue
        if reference is None:
            reference = params
        diff = None
        if len(params) == len(reference):
            diff = max((a - b).abs().max().item() for a, b in zip(params, reference))
        rows[name] = {"fields": recipe.to_dict(), "allocated_peak": peak, "step_seconds": round(seconds, 4),
                      "tokens_per_second": round(tokens / seconds), "max_abs_param_diff_vs_plain": diff,
                      "skipped_steps": int(skipped)}
        print(f"{name:32} peak {peak / 2**30:7.2f} GiB  {tokens / seconds:>9.0f} tok/s  diff {diff}", flush=True)
    device = torch.cuda.get_device_name()
    tag = "h100" if "H100" in device else device.replace(" ", "-").lower()
    _results.write(os.path.join(args.out, f"cuda-checks-{tag}.json"), _results.named(rows), cuda=torch.version.cuda,
                   model="Llama-shaped 8 x 1024, vocab 32000", batch=[8, 1024])


if __name__ == "__main__":
    main()
