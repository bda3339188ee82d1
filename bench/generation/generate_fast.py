"""The generation fast path (``memfit.generation.fast``) against the full trace of every step, and its timings at
long context on catalog models.

    python -m bench generate_fast        # prints the tables, writes bench/results/generate-fast.json

``compared``: each case estimated both ways (``fast=True``, ``fast=False``); the error is the fast path's peak
against the full trace's. ``long``: catalog models at contexts whose full trace would take hours (one forward
per new token, every block): the fast path's answer and its wall time only.
"""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file
os.environ.setdefault("MEMFIT_DEVICE", "cpu")  # graded by the CPU allocator: CPU semantics (the default is CUDA)

import torch  # noqa: E402
import transformers as tf  # noqa: E402

from memfit.generation import estimate_generate  # noqa: E402
from bench import _results  # noqa: E402

RESULTS = "generate-fast.json"
BASE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
            max_position_embeddings=1024)


def llama(layers=8, **kw):
    return lambda: tf.LlamaConfig(**{**BASE, **kw}, num_hidden_layers=layers)


def mistral():
    return tf.MistralConfig(**BASE, num_hidden_layers=8, sliding_window=16)


def mixtral():
    return tf.MixtralConfig(**BASE, num_hidden_layers=6, num_local_experts=4, num_experts_per_tok=2)


def qwen3():
    return tf.Qwen3Config(**BASE, num_hidden_layers=8, head_dim=16)


# (name, model, estimate_generate's keywords, what the case checks)
COMPARED = [
    ("llama-gqa-8l", llama(), dict(prompt_len=32, new_tokens=32, batch_size=2), "GQA, dynamic cache, bf16"),
    ("llama-long-decode-8l", llama(), dict(prompt_len=4, new_tokens=96, batch_size=2, precision="fp32"),
     "peak in the last decode step"),
    ("llama-long-prompt-8l", llama(), dict(prompt_len=256, new_tokens=16, batch_size=2), "peak in the prefill"),
    ("llama-padded-8l", llama(), dict(prompt_len=32, new_tokens=24, batch_size=3, padding=True), "left padding"),
    ("llama-logits-all-8l", llama(vocab_size=4096), dict(prompt_len=32, new_tokens=16, batch_size=2, logits_to_keep=0),
     "logits_to_keep=0: every prompt position's logits"),
    ("llama-static-8l", llama(), dict(prompt_len=32, new_tokens=32, batch_size=2, cache="static"), "static cache"),
    ("mistral-sliding-8l", mistral, dict(prompt_len=48, new_tokens=32, batch_size=2),
     "sliding window 16, prompt longer than the window"),
    ("mistral-sliding-static-8l", mistral, dict(prompt_len=48, new_tokens=16, cache="static"),
     "static cache of a sliding-window model"),
    ("qwen3-qk-norm-8l", qwen3, dict(prompt_len=32, new_tokens=32, batch_size=2), "Qwen3 (q/k norms)"),
    ("mixtral-moe-6l", mixtral, dict(prompt_len=32, new_tokens=24, precision="fp32"), "mixture of experts"),
    ("llama-nf4-8l", llama(), dict(prompt_len=32, new_tokens=24, weights="nf4"), "bitsandbytes NF4 weights"),
    ("llama-3.2-1b", "llama-3.2-1b", dict(prompt_len=512, new_tokens=32), "catalog model, 16 blocks, bf16"),
]
LONG = [
    ("llama-3.1-8b", dict(prompt_len=8192, new_tokens=256)),
    ("llama-3.1-8b", dict(prompt_len=32768, new_tokens=256)),
    ("llama-3.1-8b", dict(prompt_len=32768, new_tokens=256, batch_size=4, cache="static")),
    ("llama-3.1-70b", dict(prompt_len=130048, new_tokens=1024)),  # 128k context in all
]


def _model(model):
    return model if isinstance(model, str) else model()


def _timed(model, **kwargs):
    start = time.perf_counter()
    report = estimate_generate(_model(model), **kwargs)
    return report, round(time.perf_counter() - start, 2)


def compared(name, model, kwargs, what) -> dict:
    full, full_s = _timed(model, fast=False, **kwargs)
    fast, fast_s = _timed(model, fast=True, **kwargs)
    return {"case": name, "what": what, "settings": kwargs, "fast": fast.peak_bytes, "full": full.peak_bytes,
            "error": (fast.peak_bytes - full.peak_bytes) / full.peak_bytes, "method": fast.method,
            "fast_phases": fast.phase_peaks, "full_phases": full.phase_peaks, "fast_seconds": fast_s,
            "full_seconds": full_s}


def long(model, kwargs) -> dict:
    report, seconds = _timed(model, **kwargs)
    return {"model": model, "settings": kwargs, "peak_bytes": report.peak_bytes, "method": report.method,
            "phase_peaks": report.phase_peaks, "kv_cache_at_peak": report.by_category.get("kv_cache", 0),
            "parameters_at_peak": report.by_category.get("parameters", 0), "seconds": seconds}


def main() -> None:
    rows, longs = [], []
    print(f"{'case':28} {'fast':>13} {'full':>13} {'error':>9} {'fast s':>7} {'full s':>7}")
    for case in COMPARED:
        row = compared(*case)
        rows.append(row)
        print(f"{row['case']:28} {row['fast']:>13,} {row['full']:>13,} {100 * row['error']:>+8.4f}% "
              f"{row['fast_seconds']:>7.1f} {row['full_seconds']:>7.1f}", flush=True)
    worst = max(abs(r["error"]) for r in rows)
    exact = sum(r["fast"] == r["full"] for r in rows)
    print(f"{len(rows)} cases, byte-exact {exact}, worst |error| {100 * worst:.4f}%")
    print(f"\n{'model':14} {'prompt':>7} {'new':>5} {'batch':>5} {'cache':>8} {'peak GiB':>9} {'kv GiB':>7} {'s':>6}")
    for model, kwargs in LONG:
        row = long(model, kwargs)
        longs.append(row)
        print(f"{model:14} {kwargs['prompt_len']:>7} {kwargs['new_tokens']:>5} {kwargs.get('batch_size', 1):>5} "
              f"{kwargs.get('cache', 'dynamic'):>8} {row['peak_bytes'] / 2**30:>9.2f} "
              f"{row['kv_cache_at_peak'] / 2**30:>7.2f} {row['seconds']:>6.1f}", flush=True)
    _results.write(RESULTS, _results.tables(cases=rows, long=longs),
                   {"compared": len(rows), "byte_exact": exact, "worst_abs_error": worst}, threads=torch.get_num_threads())


if __name__ == "__main__":
    main()
