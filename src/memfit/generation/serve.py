"""``serve_plan``: how many requests of ``context`` tokens a serving process holds on one card, per
weight format, beside vLLM's paged-cache block arithmetic and the textbook KV formula.

Memory of a serving process on one card (CUDA semantics as ``memfit estimate --gpu`` reports them: the
card's ``total_memory`` less what a generating process holds outside the allocator (its CUDA context,
cuBLAS, attention kernels: ``hardware/outside.py``) is what torch's allocator can hold; the cuBLAS workspace and
the allocator's 512-byte rounding are in the traces)::

    weights + B x kv(L) + max(prefill_chunk(C), decode(B)) <= usable

**Traced** (``estimate_generate`` on fake tensors under the card's CUDA semantics, the model's own
``generate``, bf16 compute):

* ``weights``: the ``parameters`` and ``buffers`` of a short prefill, per weight format (bf16; int8 and
  nf4 are bitsandbytes' layers, the output head left in bf16 as ``from_pretrained`` leaves it);
* ``kv``: the ``kv_cache`` category of two short prefills (16 and 32 tokens): the slope is the bytes per
  token of one request, the intercept what a request holds whatever its length (a Mamba layer's state);
  the slope is checked against the analytic ``2 x layers x kv_heads x head_dim x 2 bytes``;
* ``prefill_chunk(C)``: a prefill of exactly C tokens (one request, logits of the last position only,
  as ``generate`` keeps them): its peak less weights and cache is the chunk's activations, logits and
  kernel scratch. Fake tensors cost the same to trace at any length, so each chunk is traced, not scaled;
* ``decode(B)``: one decode step at batch 1 and 4 (16-token prompts): its peak less weights and cache,
  a line in B (B rows of logits, B tokens' activations).

**Scaled** (arithmetic on the traced numbers): ``kv(L)`` to the asked context, sliding-window layers
capped at their window (read from the config's ``layer_types`` / ``sliding_window``); the batch and the
longest context, solved from the inequality above.

Next to it, two other answers for the same card:

* vLLM's (V1) — ``vllm/v1/worker/gpu_worker.py`` ``Worker.determine_available_memory``:
  ``available = total_memory x gpu_memory_utilization - non_kv_cache_memory`` where non-KV memory is
  the weights plus the peak of ``profile_run`` (``gpu_model_runner.py``: ``_dummy_run`` of
  ``max_num_batched_tokens`` tokens, then ``_dummy_sampler_run`` on ``max_num_seqs`` rows of logits);
  ``vllm/v1/core/kv_cache_utils.py`` ``get_num_blocks``: ``available // page_size`` with a page of
  ``block_size`` tokens of every layer's keys and values; a request of L tokens holds
  ``ceil(L / block_size)`` blocks. ``max_num_batched_tokens`` and ``max_num_seqs`` default as
  ``vllm serve`` sets them (``vllm/engine/arg_utils.py`` ``EngineArgs.get_batch_defaults``: 8192 and 1024
  on cards of 70 GiB or more other than the A100, 2048 and 256 otherwise). The profile run's peak is
  memfit's traced prefill of that many tokens plus the sampler's bf16 and fp32 logits;
* the analytic formula: ``params x bytes + 2 x layers x kv_heads x head_dim x L x B x 2``, no
  activations, no logits, no CUDA context, the whole card.

Known limitations:

* tensor parallelism is not modelled: a model that does not fit one card gets Accelerate's
  ``device_map`` placement over ``gpus`` cards (one forward of one chunk, each GPU's share);
* the traces are ``generate`` runs of Hugging Face's code under CUDA semantics (SDPA, no paged attention
  kernels, no CUDA graphs); each piece is allocated bytes (rounded), the caching allocator's fragmentation
  between them is not replayed: leave a margin of a few percent;
* vLLM's hybrid allocator (separate pools for sliding-window layers, Mamba state) is not modelled:
  its blocks are counted for full-attention pages of every layer;
* the KV cache is stored in the compute dtype (bf16); fp8 KV caches are not planned.
"""

from __future__ import annotations

import dataclasses
import functools

from memfit.errors import MemfitError, shown
from memfit.hardware.outside import Workload, outside
from memfit.units import format_size

__all__ = ["ServePlan", "FormatRow", "Measured", "serve_plan", "measure", "kv_layout", "max_batch", "max_context",
           "vllm_blocks", "analytic", "FORMATS", "CHUNKS"]

FORMATS = ("bf16", "int8", "nf4")  # in order of exactness: bf16 is the model as trained
_WEIGHTS = {"bf16": "auto", "int8": "int8", "nf4": "nf4"}  # estimate_generate's weights=
_ANALYTIC_BYTES = {"bf16": 2.0, "int8": 1.0, "nf4": 0.5}  # bytes per parameter the formula assumes
CHUNKS = (512, 2048, 8192)  # prefill chunk sizes tried by default (capped at the context)
SHORT = (16, 32)  # prompt lengths of the two KV traces
DECODE_BATCHES = (1, 4)  # batches of the two decode traces
KV_BYTES = 2  # bf16 keys and values
MAX_CONTEXT = 1 << 24


@dataclasses.dataclass(frozen=True)
class Measured:
    """What the traces of one weight format gave (bytes)."""
    weights: int  # parameters + buffers resident on the card
    kv_per_token: int  # one request's cache per token of context (all layers, below any window)
    kv_per_request: int  # what a request's cache holds whatever its length (recurrent state; 0 for attention)
    chunk: dict  # prefill chunk tokens -> its transient bytes (activations, logits, scratch)
    decode_base: int  # a decode step's transient bytes at batch 0 (the line through batch 1 and 4)
    decode_per_seq: int  # ... and per request of the batch
    params: int = 0  # parameters of the model as traced (before quantisation packs them)

    def decode(self, batch: int) -> int:
        return self.decode_base + self.decode_per_seq * batch


@dataclasses.dataclass(frozen=True)
class FormatRow:
    """One weight format's plan on the card."""
    format: str
    weights_bytes: int
    kv_bytes_per_request: int  # at the context asked, windows applied
    chunk: int  # the prefill chunk chosen for this format
    chunk_bytes: int  # its transient
    max_batch: int  # requests of the full context that fit at that chunk (0: none)
    max_context: int  # tokens one request can hold at batch 1, at most max_position_embeddings (0: none)
    need_bytes: int  # weights + max_batch x kv + transient at that batch
    by_chunk: dict  # chunk -> max batch, for the trade-off

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"by_chunk": {str(k): v for k, v in self.by_chunk.items()}}


@dataclasses.dataclass(frozen=True)
class ServePlan:
    model: str
    gpu: str
    context: int
    usable_bytes: int  # card memory less what the process holds outside torch's allocator
    memory_bytes: int  # the card's (or the budget's) total
    kv_analytic_per_token: int  # 2 x layers x kv_heads x head_dim x 2
    kv_measured_per_token: int
    windows: list  # per layer: its sliding window, or None
    formats: list  # FormatRow
    chosen: str | None  # the format served, or None when none fits one card
    reason: str
    vllm: dict
    analytic: dict
    placement: dict | None = None  # device_map over --gpus when nothing fits one card
    notes: list = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["formats"] = [row.to_dict() for row in self.formats]
        sliding = [w for w in self.windows if w]
        out["windows"] = {"attention_layers": len(self.windows), "sliding_layers": len(sliding),
                          "window": max(sliding) if sliding else None}
        return out


def kv_layout(config) -> tuple[int, list]:
    """(analytic bytes per token of one request, each layer's sliding window or None) from a transformers
    config: ``2 x layers x kv_heads x head_dim x 2`` over the decoder's attention layers."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layers = int(getattr(text, "num_hidden_layers", 0) or getattr(text, "n_layer", 0) or 0)
    heads = int(getattr(text, "num_attention_heads", 0) or getattr(text, "n_head", 0) or 1)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or (getattr(text, "hidden_size", 0) or 0) // heads)
    types = list(getattr(text, "layer_types", None) or ["full_attention"] * layers)
    window = getattr(text, "sliding_window", None)
    windows = [int(window) if window and "sliding" in str(kind) else None for kind in types]
    attention = [kind for kind in types if "attention" in str(kind)]
    return 2 * len(attention) * kv_heads * head_dim * KV_BYTES, [w for w, k in zip(windows, types)
                                                                 if "attention" in str(k)]


def kv_bytes(measured: Measured, windows: list, tokens: int) -> int:
    """One request's cache at ``tokens`` tokens: the measured bytes per token, each layer's share capped at
    its window, plus the per-request state."""
    if not windows:
        return measured.kv_per_token * tokens + measured.kv_per_request
    held = sum(min(tokens, w) if w else tokens for w in windows)
    return -(-measured.kv_per_token * held // len(windows)) + measured.kv_per_request


def max_batch(measured: Measured, windows: list, context: int, chunk: int, usable: int) -> int:
    """The largest B with weights + B x kv(context) + max(chunk, decode(B)) <= usable (0 when none)."""
    free = usable - measured.weights
    kv = kv_bytes(measured, windows, context)
    by_chunk = (free - measured.chunk[chunk]) // kv
    by_decode = (free - measured.decode_base) // (kv + measured.decode_per_seq)
    return max(0, min(by_chunk, by_decode))


def max_context(measured: Measured, windows: list, chunk: int, usable: int, limit: int = MAX_CONTEXT) -> int:
    """The most tokens one request can hold (prompt + output, chunked prefill of ``chunk``); 0 when none."""
    free = usable - measured.weights - max(measured.chunk[chunk], measured.decode(1))
    if kv_bytes(measured, windows, 1) > free:
        return 0
    lo, hi = 1, limit
    while lo < hi:  # kv grows with the tokens (flat past every window): the last length that fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if kv_bytes(measured, windows, mid) <= free else (lo, mid - 1)
    return lo


def vllm_defaults(memory_bytes: int, gpu_name: str) -> tuple[int, int]:
    """``vllm serve``'s (max_num_batched_tokens, max_num_seqs): ``EngineArgs.get_batch_defaults``."""
    if memory_bytes >= 70 * 1024**3 and "a100" not in gpu_name.lower():
        return 8192, 1024
    return 2048, 256


def vllm_blocks(*, memory_bytes: int, utilization: float, weights: int, profile_peak: int, kv_per_token: int,
                block_size: int, context: int, max_num_seqs: int) -> dict:
    """vLLM's KV blocks on a card and the requests of ``context`` tokens they hold (the module docstring)."""
    requested = int(memory_bytes * utilization)
    available = requested - weights - profile_peak
    page = block_size * kv_per_token
    blocks = max(0, available // page)
    per_request = -(-context // block_size)
    return {"gpu_memory_utilization": utilization, "requested_bytes": requested, "weights_bytes": weights,
            "profile_peak_bytes": profile_peak, "available_kv_bytes": available, "block_size": block_size,
            "page_bytes": page, "num_blocks": blocks, "blocks_per_request": per_request,
            "max_requests": blocks // per_request, "max_num_seqs": max_num_seqs,
            "max_concurrency": min(blocks // per_request, max_num_seqs)}


def analytic(*, memory_bytes: int, params: int, fmt: str, kv_per_token: int, context: int) -> dict:
    """The textbook answer: weights at their nominal bytes, the KV formula, nothing else, the whole card."""
    weights = int(params * _ANALYTIC_BYTES[fmt])
    per_request = kv_per_token * context
    return {"format": fmt, "weights_bytes": weights, "kv_bytes_per_request": per_request,
            "max_batch": max(0, (memory_bytes - weights) // per_request)}


def measure(model, fmt: str, chunks, *, kv: tuple | None = None, card=None) -> Measured:
    """The traces of one weight format (module docstring). ``kv``: (per token, per request) already measured
    (the cache does not depend on the weights' format). ``card``: trace under that GPU's CUDA semantics (the
    cuBLAS workspace, the allocator's rounding); None: the CPU's."""
    import logging

    from memfit.generation.generate import estimate_generate

    log = logging.getLogger("bitsandbytes.autograd._functions")  # logs its fp16 cast at every int8 layer call
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        where = {"device": "cpu"} if card is None else {"gpu": card}
        return _measure(functools.partial(estimate_generate, precision="bf16", **where), model, fmt, chunks, kv,
                        functools.partial(estimate_generate, precision="bf16", device="cpu"))
    finally:
        log.setLevel(level)


def _measure(estimate_generate, model, fmt: str, chunks, kv, cache_trace=None) -> Measured:
    """``cache_trace``: the ``estimate_generate`` the cache's bytes per token are read from (a device-independent
    figure, read at the CPU trace's peak); default ``estimate_generate``."""
    weights = _WEIGHTS[fmt]
    counted = []

    def prefill(tokens: int, trace=estimate_generate):
        report = trace(model, prompt_len=tokens, new_tokens=1, weights=weights)
        counted.append(report.parameters)
        cats = {str(k): v for k, v in report.by_category.items()}
        resident = cats.get("parameters", 0) + cats.get("buffers", 0)
        return resident, cats.get("kv_cache", 0), report.peak_bytes - resident - cats.get("kv_cache", 0)

    resident = prefill(SHORT[0])[0]
    short_kv = prefill(SHORT[0], cache_trace or estimate_generate)[1]
    if kv is None:
        long_kv = prefill(SHORT[1], cache_trace or estimate_generate)[1]
        per_token = (long_kv - short_kv) // (SHORT[1] - SHORT[0])
        kv = (per_token, max(0, short_kv - per_token * SHORT[0]))
    if kv[0] <= 0:
        raise MemfitError(f"{_name(model)}'s generate holds no KV cache that grows with the context: nothing to plan")
    chunk = {c: prefill(c)[2] for c in sorted(set(chunks))}
    decode = []
    for batch in DECODE_BATCHES:
        report = estimate_generate(model, prompt_len=SHORT[0], new_tokens=2, batch_size=batch, weights=weights)
        held = batch * (kv[0] * (SHORT[0] + 1) + kv[1])
        decode.append(max(0, report.phase_peaks.get("decode", 0) - resident - held))
    slope = max(0, (decode[1] - decode[0]) // (DECODE_BATCHES[1] - DECODE_BATCHES[0]))
    return Measured(resident, kv[0], kv[1], chunk, max(0, decode[0] - slope * DECODE_BATCHES[0]), slope, counted[0])


def serve_plan(model, *, gpu="h100-sxm", context: int, gpus: int = 1, chunks=None, allow=(),
               gpu_memory_utilization: float = 0.9, block_size: int = 16, max_num_batched_tokens: int | None = None,
               budget=None) -> ServePlan:
    """The serving plan of ``model`` on ``gpu`` at ``context`` tokens per request (prompt + output).

    chunks     prefill chunk sizes to try (default 512, 2048, 8192, capped at the context); the largest
               that keeps the batch at its best is chosen.
    allow      weight formats beside bf16 (exact by default): ``("int8", "nf4")``.
    gpus       cards of ``gpu``: used only for a device_map placement when nothing fits one card.
    budget     bytes of the card (a size such as "12GiB") instead of its catalog memory.
    gpu_memory_utilization, block_size, max_num_batched_tokens  vLLM's settings for its block arithmetic.
    """
    from memfit.hardware.gpus import gpu as lookup
    from memfit.models.source import resolve
    from memfit.units import parse_size

    card = lookup(gpu) if isinstance(gpu, str) else gpu
    context, gpus, block_size = (_count(n, v, MAX_CONTEXT) for n, v in
                                 (("context", context), ("gpus", gpus), ("block_size", block_size)))
    if not isinstance(gpu_memory_utilization, (int, float)) or not 0 < gpu_memory_utilization <= 1:
        raise MemfitError(f"gpu_memory_utilization must be in (0, 1], got {shown(gpu_memory_utilization)}")
    formats = ("bf16",) + tuple(f for f in FORMATS[1:] if f in _formats(allow))
    # a Mac's: the working set macOS gives its GPU, not its RAM (``hardware/macs.py``)
    memory = (card.working_set_bytes or card.memory_bytes) if budget is None else parse_size(budget)
    # the context and the libraries' memory outside the allocator (the cuBLAS workspace is in the traces)
    held = outside(card, Workload(kind="generate")).bytes
    usable = memory - held
    if usable <= 0:
        raise MemfitError(f"budget {format_size(memory)} is below the {format_size(held)} a process on the {card.name} "
                          "holds outside torch's allocator (CUDA context, cuBLAS): give a larger budget")
    default_tokens, max_seqs = vllm_defaults(memory, card.name)
    tokens = _count("max_num_batched_tokens", max_num_batched_tokens or default_tokens, MAX_CONTEXT)
    chunks = sorted({min(_count("chunk", c, MAX_CONTEXT), context) for c in (chunks or CHUNKS)})
    source = resolve(model)
    if source.config is None:
        raise MemfitError(f"{source.name} has no transformers config: serve-plan needs a Hugging Face causal LM")
    kv_formula, windows = kv_layout(source.config)
    measured, kv = {}, None
    for fmt in formats:
        measured[fmt] = measure(source, fmt, chunks + [tokens], kv=kv, card=card)
        kv = (measured[fmt].kv_per_token, measured[fmt].kv_per_request)
    limit = _positions(source.config)
    rows = [_row(fmt, measured[fmt], windows, context, chunks, usable, limit) for fmt in formats]
    chosen = next((row for row in rows if row.max_batch > 0), None)
    base = measured["bf16"] if chosen is None else measured[chosen.format]
    vocab = _vocab(source.config)
    sampler = max_seqs * vocab * (2 + 4)  # the dummy sampler's bf16 logits and their fp32 copy
    vllm = vllm_blocks(memory_bytes=memory, utilization=float(gpu_memory_utilization), weights=base.weights,
                       profile_peak=base.chunk[tokens] + sampler, kv_per_token=base.kv_per_token,
                       block_size=block_size, context=context, max_num_seqs=max_seqs)
    vllm |= {"max_num_batched_tokens": tokens, "format": chosen.format if chosen else "bf16"}
    params = measured["bf16"].params
    formula = analytic(memory_bytes=memory, params=params, fmt=chosen.format if chosen else "bf16",
                       kv_per_token=kv_formula, context=context)
    notes = _notes(kv_formula, kv[0], kv[1], windows, source.config, context)
    placement = None if chosen is not None else _placement(source, card, gpus, min(chunks), base, usable)
    return ServePlan(model=source.name, gpu=card.name, context=context, usable_bytes=usable, memory_bytes=memory,
                     kv_analytic_per_token=kv_formula, kv_measured_per_token=kv[0], windows=windows,
                     formats=rows, chosen=chosen.format if chosen else None,
                     reason=_reason(chosen, rows, context, placement), vllm=vllm, analytic=formula,
                     placement=placement, notes=notes)


def _row(fmt, measured: Measured, windows, context, chunks, usable, limit) -> FormatRow:
    by_chunk = {c: max_batch(measured, windows, context, c, usable) for c in chunks}
    best = max(by_chunk.values())
    chunk = max(c for c, b in by_chunk.items() if b == best)  # the largest chunk that keeps the best batch
    need = measured.weights + best * kv_bytes(measured, windows, context) + max(measured.chunk[chunk],
                                                                                 measured.decode(best))
    return FormatRow(fmt, measured.weights, kv_bytes(measured, windows, context), chunk, measured.chunk[chunk],
                     best, max_context(measured, windows, chunk, usable, limit), need, by_chunk)


def _reason(chosen, rows, context, placement) -> str:
    if chosen is None:
        tail = placement["summary"] if placement else ""
        return f"no allowed weight format holds one request of {context} tokens on one card" + (f"; {tail}" if tail else "")
    why = "bf16, the model's own weights" if chosen.format == "bf16" else \
        f"{chosen.format}, the most exact allowed format that holds a request"
    bigger = [c for c in chosen.by_chunk if c > chosen.chunk]
    if bigger:
        c = min(bigger)
        why += f"; chunk {chosen.chunk} (chunk {c} holds {chosen.by_chunk[c]}, not {chosen.max_batch})"
    more = [f"{r.format} holds {r.max_batch}" for r in rows if r.max_batch > chosen.max_batch]
    if more:
        why += f"; {', '.join(more)} (less exact weights)"
    return why


def _placement(source, card, gpus, chunk, measured: Measured, usable) -> dict:
    """Accelerate's device_map over ``gpus`` cards (one forward of ``chunk`` tokens), or how many cards the
    weights alone would need."""
    cards = max(2, -(-measured.weights // max(1, usable)))
    if gpus < 2:
        return {"gpus": 1, "summary": f"the weights alone need at least {cards} cards: rerun with --gpus {cards} "
                "for a device_map placement (tensor parallelism is not modelled)"}
    from memfit.estimator.estimate import estimate

    share = usable  # each card's memory less its CUDA context, as from_pretrained's default
    report = estimate(source, device_map="auto", gpus=gpus, gpu=card, workload="forward", precision="bf16",
                      seq_len=chunk, batch_size=1, steps=1, max_memory={i: share for i in range(gpus)})
    devices = [{"device": d["device"], "bytes": d.get("device_bytes", d["peak_bytes"]), "verdict": d.get("verdict")}
               for d in report.devices or []]
    fits = all(d["verdict"] in (None, "fits") for d in devices if d["device"].startswith("cuda"))
    return {"gpus": gpus, "devices": devices, "fits": fits, "summary":
            f"device_map auto over {gpus} x {card.name} (a {chunk}-token forward, no KV cache beside it) "
            + ("fits" if fits else "does not fit") + "; tensor parallelism is not modelled"}


def _notes(formula, per_token, per_request, windows, config, context) -> list:
    notes = []
    if formula != per_token:
        notes.append(f"traced KV {per_token} B/token differs from the formula's {formula} B/token "
                     "(2 x layers x kv_heads x head_dim x 2): the trace is what the model's cache holds")
    if per_request:
        notes.append(f"each request also holds {per_request} B whatever its length (recurrent state, counters)")
    if any(windows):
        notes.append(f"{sum(1 for w in windows if w)} of {len(windows)} attention layers keep a window of "
                     f"{max(w for w in windows if w)} tokens")
    limit = _positions(config)
    if context > limit:
        notes.append(f"context {context} is past the model's max_position_embeddings {limit}")
    return notes


def _positions(config) -> int:
    """The model's ``max_position_embeddings`` (the longest context ``max_context`` reports), else the bound."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and 0 < limit < MAX_CONTEXT else MAX_CONTEXT


def _vocab(config) -> int:
    from memfit.generation.run import vocab_size

    return vocab_size(config)


def _formats(allow) -> tuple:
    names = tuple(a.strip() for a in (allow.split(",") if isinstance(allow, str) else allow or ()) if a.strip())
    bad = [a for a in names if a not in FORMATS]
    if bad:
        raise MemfitError(f"weight format {shown(bad[0])} unknown: allow int8, nf4 (bf16 is always planned)")
    return names


def _count(name: str, value, limit: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= limit:
        raise MemfitError(f"{name} must be an integer from 1 to {limit}, got {shown(value)}")
    return value


def _name(model) -> str:
    return getattr(model, "name", str(model))
