"""The KV cache of a generation: which kind ``generate`` builds, and the tensors that hold it.

transformers builds the cache inside ``generate`` from ``cache_implementation``: a ``DynamicCache``
(grown by ``torch.cat`` each step; sliding-window layers keep only their window, so Mistral's and
Gemma 3's local layers stop growing), a ``StaticCache`` (every layer's buffers allocated once at their
full length; sliding layers at the window), their offloaded variants (layers moved to the CPU between
uses: on the CPU, where the cache already is, a no-op), and a ``QuantizedCache`` (the states stored
quantised; the ``fp8`` backend needs nothing installed, ``quanto`` and ``hqq`` their packages).
An encoder-decoder model pairs a self-attention cache with a cross-attention one
(``EncoderDecoderCache``): the encoder's keys and values, computed once in the first decoder step.

``cache_tensors`` walks whatever cache object the model was handed (every tensor reachable through its
layers' attributes), so a kind added by transformers later is still found.
"""

from __future__ import annotations

import importlib.util

import torch

from memfit.errors import MemfitError, shown

__all__ = ["CACHES", "QUANTIZED_BACKENDS", "cache_kwargs", "cache_tensors", "find_cache"]

#: What ``cache=`` accepts: transformers' ``cache_implementation`` names (``quantized`` with a backend:
#: ``quantized`` is ``quantized:fp8``).
CACHES = ("dynamic", "static", "offloaded", "offloaded_static", "quantized")
QUANTIZED_BACKENDS = {"fp8": None, "quanto": "optimum.quanto", "hqq": "hqq"}  # backend -> the package it needs


def cache_kwargs(cache: str, *, encoder_decoder: bool) -> dict:
    """``generate``'s keyword arguments for the cache ``cache`` (a value of ``CACHES``, or
    ``quantized:BACKEND``); a one-line error for a name it does not know or a backend not installed."""
    kind, _, backend = str(cache).partition(":")
    if kind not in CACHES or (backend and kind != "quantized"):
        raise MemfitError(f"cache {shown(cache)} is not a cache transformers builds: use one of {', '.join(CACHES)} "
                          f"(quantized:fp8, quantized:quanto or quantized:hqq for a quantised one)")
    if kind == "dynamic":
        return {}
    if kind != "quantized":
        return {"cache_implementation": kind}
    backend = backend or "fp8"
    if backend not in QUANTIZED_BACKENDS:
        raise MemfitError(f"quantized cache backend {shown(backend)} unknown: use fp8, quanto or hqq")
    package = QUANTIZED_BACKENDS[backend]
    if package is not None and importlib.util.find_spec(package.split(".")[0]) is None:
        raise MemfitError(f"cache=quantized:{backend} needs {package.split('.')[0]}: pip install "
                          f"{'optimum-quanto' if backend == 'quanto' else 'hqq'}, or use quantized:fp8")
    if encoder_decoder:
        raise MemfitError("cache=quantized and an encoder-decoder model conflict: transformers quantises the cache of "
                          "decoder-only models; use dynamic or static")
    return {"cache_implementation": "quantized", "cache_config": {"backend": backend}}


def find_cache(kwargs: dict, output=None):
    """The cache object of one forward of a generation: handed in (``cache``, or ``past_key_values`` before
    transformers 5.x renamed it) or returned."""
    for name in ("cache", "past_key_values"):
        found = kwargs.get(name)
        if found is not None:
            return found
        found = getattr(output, name, None) if output is not None and not isinstance(output, torch.Tensor) else None
        if found is not None:
            return found
    return None


def cache_tensors(cache) -> list[torch.Tensor]:
    """Every tensor reachable from a cache object: its layers' keys and values, quantised states and
    their scales, static buffers, counters; both halves of an encoder-decoder cache."""
    # NOTE: a loop, not a recursive closure: a closure that calls itself is a reference cycle, and the
    # list it fills would keep each step's old keys and values alive until the garbage collector ran.
    found, seen, todo = [], set(), [(cache, 0)]
    while todo:
        value, depth = todo.pop()
        if depth > 6 or id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            todo.extend((item, depth + 1) for item in value)
        elif isinstance(value, dict):
            todo.extend((item, depth + 1) for item in value.values())
        elif hasattr(value, "__dict__") and not isinstance(value, (type, torch.nn.Module)) \
                and type(value).__module__.startswith("transformers"):
            todo.extend((item, depth + 1) for item in vars(value).values())
    return found
