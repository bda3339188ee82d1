"""Inference: the memory of a Hugging Face ``generate`` (prefill, then decode), estimated on fake tensors.

    from memfit.generation import estimate_generate
    report = estimate_generate("llama-3.2-1b", prompt_len=512, new_tokens=128, batch_size=4)
    report.peak_bytes, report.by_category["kv_cache"], report.phase_peaks   # prefill and decode

``generate.py`` the estimate, ``run.py`` the ``generate`` call estimate and truth share, ``cache.py`` the
KV cache kinds and the tensors they hold, ``weights.py`` dtype / bitsandbytes int8 / NF4 weights,
``values.py`` the real values of the prompt's small tensors that ``generate``'s branches read,
``truth.py`` the CPU allocator's peak of the real run, ``workloads.py`` ``memfit.estimate``'s
``workload="generate"``. It sits beside ``training``: above ``estimator``, below ``cli``.
"""

from __future__ import annotations

__all__ = ["estimate_generate"]


def __getattr__(name: str):
    if name == "estimate_generate":  # imported on first use: ``import memfit.generation`` loads no torch
        from memfit.generation.generate import estimate_generate

        return estimate_generate
    raise AttributeError(f"module 'memfit.generation' has no attribute {name!r}")
