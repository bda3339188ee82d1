"""``estimate_generate``: the memory of a Hugging Face ``generate`` (prefill, then decode), on fake tensors.

The model's own ``generate`` runs, unchanged, on a fake copy of the model under the ledger that
estimates training steps (``accounting/ledger.py``): the prompt's forward (``prefill``), then one
forward per new token (``decode``), the KV cache transformers builds for the ``cache`` asked
(``cache.py``), the logits generate keeps, its masks and position ids. Every storage is an allocation
of its bytes, and the cache object's tensors are marked ``kv_cache``. Kernel scratch is replayed as for
training (``accounting/scratch.py``). Graded against the CPU allocator running the same ``generate``
for real (``truth.py``; ``bench/generation/generate.py``).

``generate`` reads tensors to decide what to do (padding in the mask, whether every sequence has
finished): the values of small tensors made from the prompt follow the fake run (``values.py``), so
the branches are those of the real run.

Known limitations:

* exactly ``new_tokens`` tokens, greedy, one beam (``eos_token_id=None``): the longest generation the
  request allows. Sampling keeps the same tensors but a few (the probabilities); beams multiply the
  batch; neither is estimated yet;
* the whole generation is traced, every decode step: thousands of new tokens of a deep model take
  minutes (no depth fast path for generation yet);
* CPU semantics only (what the CPU allocator holds): ``cache="offloaded"`` needs a GPU and is refused;
* data the fake run cannot know: a mixture-of-experts layer's routing (``balanced`` assumed, as in
  ``hardware/cpu_kernels.py``: it moves bf16 kernel scratch only, measured within 1.7 % of a tiny
  Qwen2-MoE's peak, ``worst`` bounds it) and LLM.int8's outlier columns (none assumed, ``weights.py``).
"""

from __future__ import annotations

import dataclasses

from memfit.errors import MemfitError, shown
from memfit.estimator.fake import quiet_fake_log
from memfit.estimator.estimate import check_switches
from memfit.generation.cache import cache_kwargs
from memfit.generation.full import estimate_full
from memfit.generation.run import Request
from memfit.generation.weights import DTYPES, WEIGHTS
from memfit.hardware.cpu_kernels import check_routing
from memfit.hardware.gpus import target
from memfit.models.source import resolve
from memfit.report.report import Report
from memfit.units import parse_size

__all__ = ["estimate_generate", "check_request", "check_generate_args", "MAX_TOKENS", "MAX_BATCH"]

# Bounds past which a trace would run for hours or byte counts overflow 64 bits.
MAX_TOKENS = 1 << 20
MAX_BATCH = 1 << 16


def estimate_generate(model, *, prompt_len: int, new_tokens: int, batch_size: int = 1, precision: str | None = None,
                      cache: str = "dynamic", weights: str = "auto", padding: bool = False,
                      logits_to_keep: int | None = None, device: str | None = None, moe_routing: str = "balanced",
                      fast: bool | None = None, progress=None, gpu=None, budget=None) -> Report:
    """Estimate the peak memory of ``model.generate`` on ``batch_size`` prompts of ``prompt_len`` tokens,
    generating ``new_tokens`` more, without allocating it.

    model         anything ``memfit.estimate`` takes (a catalog name, a Hugging Face Hub id or config.json,
                  a transformers config, an ``nn.Module``, a factory) whose model can ``generate``: a
                  causal LM or an encoder-decoder (T5, BART: the prompt is the encoder's input).
    precision     the dtype of the weights and activations: ``bf16``, ``fp16`` or ``fp32``; None (default): the
                  model config's own dtype (``dtype``, ``torch_dtype`` before transformers 5), bf16 where it names
                  none. ``settings["precision_from"]`` says which: ``given``, ``config`` or ``default``.
    cache         the KV cache transformers builds (``cache_implementation``): ``dynamic`` (default;
                  sliding-window layers keep their window), ``static``, ``quantized`` (``quantized:fp8``;
                  ``quantized:quanto`` / ``quantized:hqq`` need those packages); ``offloaded`` and
                  ``offloaded_static`` need a GPU and are refused with CPU semantics.
    weights       the linear layers' storage: ``auto`` (``precision``), ``int8`` (bitsandbytes LLM.int8,
                  ``load_in_8bit``) or ``nf4`` (bitsandbytes 4-bit NF4, ``load_in_4bit``, double-quantised,
                  ``precision`` as compute dtype), ``ao-int8wo`` (torchao ``Int8WeightOnlyConfig``) or
                  ``ao-int8da8w`` (torchao ``Int8DynamicActivationInt8WeightConfig``); the output embedding
                  stays in ``precision``, as ``from_pretrained`` leaves it.
    padding       left-pad the prompts (rows after the first shorter): transformers then builds a 4-D
                  attention mask in every forward.
    logits_to_keep  positions whose logits the prefill computes; None: ``generate``'s own choice (the
                  last one, for models that accept ``logits_to_keep``); 0: all of them.
    fast          trace only the prefill and the last decode step, on a shallow copy written out at full depth
                  (``fast.py``); None (default): when the full trace would run more than ``FAST_FROM`` block
                  forwards ((new_tokens + 1) x depth); False: trace every forward; True: refuse where it is not exact.
    progress      ``progress(done, total)``, called as each forward begins and when the replay is done.
    device, gpu   whose semantics to follow, as for ``memfit.estimate``: CUDA by default (``gpu``: the card
                  given, else the GPU torch sees, else ``h100-sxm``), with ``reserved_bytes``, the CUDA context
                  and the verdict (``device.py``); ``device="cpu"``: byte-exact against the CPU allocator.
    budget        CUDA only: the memory the process may use, context included (bytes or "24GiB").

    The report's ``phase_peaks`` are ``prefill`` and ``decode``, its ``step_peaks`` one per forward
    (the prefill, then each decode step), ``by_category`` adds ``kv_cache``, and ``settings["workload"]``
    is ``"generate"``.
    """
    request = check_request(prompt_len, new_tokens, batch_size, cache, padding, logits_to_keep)
    check_switches(fast=fast, progress=progress)
    chosen = target(device, gpu)
    card = chosen.gpu
    check_generate_args("bf16" if precision is None else precision, weights, chosen.device, cache)  # None: below
    limit = None
    if budget is not None:
        if card is None:
            raise MemfitError("budget applies to CUDA estimates (the allocator under a memory fraction): drop "
                              "device='cpu', or compare report.peak_bytes yourself")
        limit = parse_size(budget)
    source = dataclasses.replace(resolve(model), moe_routing=check_routing(moe_routing))
    precision, precision_from, precision_note = _precision(precision, source.config)
    # building a transformers model writes the dtype it was built in into its config: the caller's config (a
    # Source reused, a config object) must name the same dtype after the estimate as before it
    config, named = source.config, vars(source.config).get("dtype") if source.config is not None else None
    try:
        with quiet_fake_log():
            from memfit.generation.fast import choose_fast, estimate_fast

            go, note = choose_fast(fast, source, request)
            if go:
                report = estimate_fast(source, request, precision, weights, progress, gpu=card, budget=limit)
            else:
                report = estimate_full(source, request, precision, weights, progress, gpu=card, budget=limit)
                report = dataclasses.replace(report, notes=report.notes + [note]) if note else report
    finally:
        if config is not None:
            vars(config)["dtype"] = named
    report = dataclasses.replace(report, notes=report.notes + ([precision_note] if precision_note else []),
                                 settings={**report.settings, "precision_from": precision_from})
    return dataclasses.replace(report, settings={**report.settings, "target": chosen.how})


def check_request(prompt_len, new_tokens, batch_size, cache, padding, logits_to_keep) -> Request:
    """A ``Request`` of checked values, or a one-line error naming the bad one."""
    for name, value, limit in (("prompt_len", prompt_len, MAX_TOKENS), ("new_tokens", new_tokens, MAX_TOKENS),
                               ("batch_size", batch_size, MAX_BATCH)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= limit:
            raise MemfitError(f"{name} must be an integer from 1 to {limit}, got {shown(value)}")
    if logits_to_keep is not None and (not isinstance(logits_to_keep, int) or isinstance(logits_to_keep, bool)
                                       or not 0 <= logits_to_keep <= prompt_len):
        raise MemfitError(f"logits_to_keep must be an integer from 0 (all) to prompt_len={prompt_len}, got "
                          f"{shown(logits_to_keep)}")
    if padding and batch_size < 2:
        raise MemfitError("padding=True pads the shorter prompts of a batch: use batch_size >= 2")
    cache_kwargs(cache, encoder_decoder=False)  # the name, and its backend installed
    return Request(prompt_len, new_tokens, batch_size, cache, bool(padding), logits_to_keep)


def check_generate_args(precision: str, weights: str, device: str, cache: str = "dynamic") -> None:
    """A one-line error for a dtype, weight format, device or cache this estimate does not run."""
    if precision not in DTYPES:
        raise MemfitError(f"precision {shown(precision)} is not a generation dtype: use one of {', '.join(DTYPES)}")
    if weights not in WEIGHTS:
        raise MemfitError(f"weights {shown(weights)} unknown: use one of {', '.join(WEIGHTS)}")
    if str(device).split(":")[0] not in ("cpu", "cuda"):
        raise MemfitError(f"device {shown(device)} is not modelled: use device='cpu' or device='cuda'")
    if str(cache).startswith("offloaded"):
        raise MemfitError(f"cache={cache} moves each layer's cache from the GPU to the host between uses (CUDA "
                          "streams): it needs a GPU, and on the CPU the cache is in host memory already; use "
                          f"cache={'static' if cache == 'offloaded_static' else 'dynamic'}")


def _precision(precision: str | None, config) -> tuple[str, str, str | None]:
    """The generation's dtype, where it comes from (``given``, ``config``, ``default``) and the report's note
    on it: the one asked for, else the config's own (``dtype``, or ``torch_dtype`` before transformers 5),
    else bf16."""
    if precision is not None:
        return precision, "given", None
    value = getattr(config, "dtype", None) if config is not None else None
    if value is None and config is not None:
        value = vars(config).get("torch_dtype")  # transformers 4 (5 reads it into dtype, and warns on the name)
    if value is None:
        why = "the config names none" if config is not None else "the model has no config to name one"
        return "bf16", "default", f"precision bf16: default, {why}"
    names = {str(dtype).removeprefix("torch."): name for name, dtype in DTYPES.items()}
    named = str(value).removeprefix("torch.")
    if named not in names:
        return "bf16", "default", (f"precision bf16: default, the config's dtype {named} is not one of "
                                   f"{', '.join(DTYPES)}")
    return names[named], "config", f"precision {names[named]}: the config's dtype"
