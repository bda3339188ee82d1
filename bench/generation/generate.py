"""A Hugging Face ``generate`` estimated on fake tensors vs the CPU allocator running it for real.

    python -m bench generate        # prints the table, writes bench/results/generate-cpu.json

Each case is a tiny model of a family (2-3 blocks, width 64, random weights) generating greedily, exactly
``new_tokens`` tokens: the estimate is ``memfit.generation.estimate_generate``, the truth
``memfit.generation.truth.true_peak_generate`` (the same ``generate`` on real tensors under ``torch.profiler``
with ``profile_memory=True``, plus the resident weights and prompt). A case that cannot run says why in
the JSON (``skipped``), never with a traceback.
"""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file
os.environ.setdefault("MEMFIT_DEVICE", "cpu")  # graded by the CPU allocator: CPU semantics (the default is CUDA)
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import torch  # noqa: E402
import transformers as tf  # noqa: E402

from memfit.errors import MemfitError  # noqa: E402
from memfit.generation import estimate_generate  # noqa: E402
from memfit.generation.run import Request  # noqa: E402
from memfit.generation.truth import true_peak_generate  # noqa: E402
from memfit.models.source import resolve  # noqa: E402
from bench import _results  # noqa: E402

RESULTS = "generate-cpu.json"
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=512)
WINDOW = 16  # sliding window of the sliding-attention cases: shorter than prompt + new tokens


def llama(**kw):
    return tf.LlamaConfig(**{**BASE, **kw})


def mistral():
    return tf.MistralConfig(**BASE, sliding_window=WINDOW)


def qwen2_sliding():
    return tf.Qwen2Config(**BASE, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)


def gemma3():
    layers = ["sliding_attention", "sliding_attention", "full_attention"]
    return tf.Gemma3TextConfig(**{**BASE, "num_hidden_layers": 3}, head_dim=16, sliding_window=WINDOW,
                               layer_types=layers)


def mixtral():
    return tf.MixtralConfig(**BASE, num_local_experts=4, num_experts_per_tok=2)


def qwen2_moe():
    return tf.Qwen2MoeConfig(**BASE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                             shared_expert_intermediate_size=64)


def t5():
    return tf.T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=256,
                       decoder_start_token_id=0)


def bart():
    return tf.BartConfig(d_model=64, encoder_ffn_dim=128, decoder_ffn_dim=128, encoder_layers=2, decoder_layers=2,
                         encoder_attention_heads=4, decoder_attention_heads=4, vocab_size=256,
                         max_position_embeddings=512)


GEN = dict(prompt_len=32, new_tokens=16)
# (name, config, estimate_generate's keywords, what the case checks)
CASES = [
    ("llama-gqa", llama, dict(GEN, precision="fp32"), "grouped-query attention (4 query / 2 kv heads), dynamic cache"),
    ("llama-gqa-bf16", llama, dict(GEN, batch_size=2), "bf16 weights and activations"),
    ("llama-long-decode", llama, dict(prompt_len=4, new_tokens=96, batch_size=2, precision="fp32"),
     "peak in the last decode step: the grown cache"),
    ("llama-left-padded", llama, dict(GEN, batch_size=3, padding=True), "batch 3, left padding: a 4-D mask each step"),
    ("llama-vocab-default", lambda: llama(vocab_size=4096), dict(GEN, batch_size=2),
     "logits_to_keep left to generate (1: the prefill keeps the last position's logits)"),
    ("llama-vocab-logits-all", lambda: llama(vocab_size=4096), dict(GEN, batch_size=2, logits_to_keep=0),
     "logits_to_keep=0: the prefill computes every position's logits"),
    ("mistral-sliding", mistral, dict(GEN, batch_size=2),
     f"sliding window {WINDOW}: the dynamic cache keeps the window"),
    ("qwen2-sliding", qwen2_sliding, dict(GEN), "sliding window on the layers past max_window_layers only"),
    ("gemma3-hybrid", gemma3, dict(GEN, batch_size=2), "Gemma 3: sliding and full attention layers"),
    ("gemma3-hybrid-static", gemma3, dict(GEN, batch_size=2, cache="static"),
     "static cache: sliding layers get window-sized buffers"),
    ("mixtral-moe", mixtral, dict(GEN, precision="fp32"), "mixture of experts (4 experts, top 2)"),
    ("qwen2-moe", qwen2_moe, dict(GEN, batch_size=2, precision="fp32"), "mixture of experts with a shared expert"),
    ("qwen2-moe-bf16", qwen2_moe, dict(GEN, batch_size=2),
     "bf16 experts: CPU grouped_mm scratch follows the routing, which is data (worst_routing: the bound)"),
    ("t5-encoder-decoder", t5, dict(GEN, precision="fp32"), "encoder once; self- and cross-attention caches"),
    ("bart-encoder-decoder-padded", bart, dict(GEN, batch_size=3, padding=True), "encoder-decoder, padded batch"),
    ("t5-static", t5, dict(GEN, cache="static"), "encoder-decoder with static caches"),
    ("llama-static", llama, dict(GEN, batch_size=2, cache="static"),
     "static cache (prompt + new tokens, allocated once)"),
    ("mistral-static-sliding", mistral, dict(GEN, cache="static"), "static cache of a sliding-window model"),
    ("llama-quantized-fp8", llama, dict(GEN, batch_size=2, cache="quantized"), "quantised cache (fp8 backend)"),
    ("llama-quantized-quanto", llama, dict(GEN, cache="quantized:quanto"), "quantised cache (quanto backend)"),
    ("llama-quantized-hqq", llama, dict(GEN, cache="quantized:hqq"), "quantised cache (HQQ backend)"),
    ("llama-offloaded", llama, dict(GEN, cache="offloaded"), "offloaded cache"),
    ("llama-int8", llama, dict(GEN, precision="fp16", weights="int8"), "bitsandbytes LLM.int8 weights"),
    ("mistral-int8-bf16", mistral, dict(GEN, batch_size=2, weights="int8"), "int8 weights, bf16 activations"),
    ("llama-nf4", llama, dict(GEN, weights="nf4"), "bitsandbytes NF4 weights (double-quantised), bf16 compute"),
    ("mixtral-nf4", mixtral, dict(GEN, batch_size=2, weights="nf4"), "NF4 linear layers of a mixture of experts"),
    ("qwen2-moe-nf4", qwen2_moe, dict(GEN, batch_size=2, weights="nf4"),
     "NF4 with a 1-output linear layer (shared_expert_gate): bitsandbytes' CPU repacking refuses it"),
    ("llama-ao-int8wo", llama, dict(GEN, weights="ao-int8wo"), "torchao Int8WeightOnlyConfig (Int8Tensor), bf16"),
    ("mistral-ao-int8wo-fp16", mistral, dict(GEN, batch_size=2, precision="fp16", weights="ao-int8wo"),
     "torchao int8 weight-only, fp16 activations, sliding window"),
    ("llama-ao-int8da8w", llama, dict(GEN, batch_size=2, weights="ao-int8da8w"),
     "torchao Int8DynamicActivationInt8WeightConfig: int8 activations per token, sum kernel scratch replayed"),
]


def _truth(config, kwargs) -> int:
    request = Request(kwargs["prompt_len"], kwargs["new_tokens"], kwargs.get("batch_size", 1),
                      kwargs.get("cache", "dynamic"), kwargs.get("padding", False), kwargs.get("logits_to_keep"))
    return true_peak_generate(resolve(config).build, request, precision=kwargs.get("precision", "bf16"),
                              weights=kwargs.get("weights", "auto"))


def _line(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).strip() or '-').splitlines()[0]}"


def run_case(name, config, kwargs) -> dict:
    config = config()
    start = time.perf_counter()
    try:
        report = estimate_generate(config, **kwargs)
    except Exception as err:  # noqa: BLE001 — an estimate that fails is a result too, in one line
        reason = str(err) if isinstance(err, MemfitError) else f"the estimate failed: {_line(err)}"
        if "failed" in reason:  # does the real generate fail too?
            try:
                _truth(config, kwargs)
                reason += "; the real generate runs"
            except Exception as real:  # noqa: BLE001
                reason += f"; the real generate fails too ({_line(real)})"
        return {"skipped": reason}
    seconds = time.perf_counter() - start
    try:
        truth = _truth(config, kwargs)
    except Exception as err:  # noqa: BLE001 — the real run is graded, its failure is a result
        return {"skipped": f"the real generate failed: {_line(err)}"}
    bound = {}
    if report.by_category and kwargs.get("precision", "bf16") != "fp32" and any("mixture" in n for n in report.notes):
        worst = estimate_generate(config, **kwargs, moe_routing="worst").peak_bytes
        bound = {"worst_routing": worst, "worst_routing_error": (worst - truth) / truth}
    return {"estimated": report.peak_bytes, "measured": truth, "error": (report.peak_bytes - truth) / truth, **bound,
            "kv_cache_at_peak": report.by_category.get("kv_cache", 0), "phase_peaks": report.phase_peaks,
            "modelled_scratch": report.modelled_bytes, "estimate_seconds": round(seconds, 3)}


def main() -> None:
    rows = []
    print(f"{'case':30} {'estimated':>11} {'measured':>11} {'error':>9} {'kv cache':>9} {'est. s':>7}")
    for name, config, kwargs, what in CASES:
        row = {"case": name, "what": what, "settings": kwargs, **run_case(name, config, kwargs)}
        rows.append(row)
        if "skipped" in row:
            print(f"{name:30} skipped: {row['skipped']}", flush=True)
        else:
            print(f"{name:30} {row['estimated']:>11,} {row['measured']:>11,} {100 * row['error']:>+8.4f}% "
                  f"{row['kv_cache_at_peak']:>9,} {row['estimate_seconds']:>7.2f}", flush=True)
    graded = [r for r in rows if "error" in r]
    worst = max(abs(r["error"]) for r in graded)
    within = sum(abs(r["error"]) <= 0.01 for r in graded)
    exact = sum(r["estimated"] == r["measured"] for r in graded)
    print(f"{len(graded)} cases graded ({len(rows) - len(graded)} skipped), within 1 %: {within}, byte-exact {exact}, "
          f"worst |error| {100 * worst:.4f}%")
    _results.write(RESULTS, rows, {"graded": len(graded), "within_1_percent": within, "byte_exact": exact,
                                   "worst_abs_error": worst}, threads=torch.get_num_threads())


if __name__ == "__main__":
    main()
