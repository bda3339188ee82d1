"""``estimate_generate``: the memory of a Hugging Face ``generate`` (prefill, then decode), on fake tensors.

The model's own ``generate`` runs, unchanged, on a fake copy of the model under the ledger that
estimates training steps (``accounting/ledger.py``): the prompt's forward (``prefill``), then one
forward per new token (``decode``), the KV cache transformers builds for the ``cache`` asked
(``cache.py``), the logits generate keeps, its masks and position ids. Every storage is an allocation
of its bytes, and the cache object's tensors are marked ``kv_cache``. Kernel scratch is replayed as for
training (``accounting/scratch.py``). Graded against the CPU allocator running the same ``generate``
for real (``truth.py``; ``bench/generate.py``).

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

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedFakeTensorException,
    UnsupportedOperatorException,
)

from memfit.accounting.ledger import Ledger
from memfit.accounting.replay import replay
from memfit.accounting.scratch import measure_scratch
from memfit.categories import GENERATE_PHASES, Category
from memfit.errors import MemfitError, shown
from memfit.estimator.fake import build_fake, fake_copy, quiet_fake_log
from memfit.estimator.trace import fold_peaks, numel
from memfit.generation.cache import cache_kwargs
from memfit.generation.run import Request, prompt_batch, run_generate, vocab_size
from memfit.generation.values import LIMIT, KnownValues
from memfit.generation.weights import DTYPES, WEIGHTS, Outliers, quantize_weights
from memfit.hardware.cpu_kernels import CpuKernels, check_routing
from memfit.models.source import resolve
from memfit.report.report import Report
from memfit.scoped import patched

__all__ = ["estimate_generate", "check_request", "check_generate_args", "MAX_TOKENS", "MAX_BATCH"]

# CPU kernels whose scratch a generation's peak can sit on, replayed beside the training step's (conv, RNN,
# low-precision matmuls): SDPA's flash kernel allocates per-thread blocks inside itself (2,880 B per call of a
# tiny Llama's 12-token prefill on 2 threads), growing with the prompt and the threads.
PROBED = frozenset({"_scaled_dot_product_flash_attention_for_cpu"})
# Bounds past which a trace would run for hours or byte counts overflow 64 bits.
MAX_TOKENS = 1 << 20
MAX_BATCH = 1 << 16


def estimate_generate(model, *, prompt_len: int, new_tokens: int, batch_size: int = 1, precision: str = "bf16",
                      cache: str = "dynamic", weights: str = "auto", padding: bool = False,
                      logits_to_keep: int | None = None, device: str = "cpu", moe_routing: str = "balanced",
                      progress=None) -> Report:
    """Estimate the peak memory of ``model.generate`` on ``batch_size`` prompts of ``prompt_len`` tokens,
    generating ``new_tokens`` more, without allocating it.

    model         anything ``memfit.estimate`` takes (a catalog name, a Hugging Face Hub id or config.json,
                  a transformers config, an ``nn.Module``, a factory) whose model can ``generate``: a
                  causal LM or an encoder-decoder (T5, BART: the prompt is the encoder's input).
    precision     the dtype of the weights and activations: ``bf16`` (default), ``fp16`` or ``fp32``.
    cache         the KV cache transformers builds (``cache_implementation``): ``dynamic`` (default;
                  sliding-window layers keep their window), ``static``, ``quantized`` (``quantized:fp8``;
                  ``quantized:quanto`` / ``quantized:hqq`` need those packages); ``offloaded`` and
                  ``offloaded_static`` need a GPU and are refused with CPU semantics.
    weights       the linear layers' storage: ``auto`` (``precision``), ``int8`` (bitsandbytes LLM.int8,
                  ``load_in_8bit``) or ``nf4`` (bitsandbytes 4-bit NF4, ``load_in_4bit``, double-quantised,
                  ``precision`` as compute dtype); the output embedding stays in ``precision``, as
                  ``from_pretrained`` leaves it.
    padding       left-pad the prompts (rows after the first shorter): transformers then builds a 4-D
                  attention mask in every forward.
    logits_to_keep  positions whose logits the prefill computes; None: ``generate``'s own choice (the
                  last one, for models that accept ``logits_to_keep``); 0: all of them.
    progress      ``progress(done, total)``, called as each forward begins and when the replay is done.

    The report's ``phase_peaks`` are ``prefill`` and ``decode``, its ``step_peaks`` one per forward
    (the prefill, then each decode step), ``by_category`` adds ``kv_cache``, and ``settings["workload"]``
    is ``"generate"``.
    """
    request = check_request(prompt_len, new_tokens, batch_size, cache, padding, logits_to_keep)
    check_generate_args(precision, weights, device, cache)
    source = dataclasses.replace(resolve(model), moe_routing=check_routing(moe_routing))
    with quiet_fake_log():
        return _estimate(source, request, precision, weights, progress)


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
    if str(device).split(":")[0] != "cpu":
        raise MemfitError(f"device {shown(device)}: a generation is estimated with CPU semantics only so far "
                          "(device='cpu')")
    if str(cache).startswith("offloaded"):
        raise MemfitError(f"cache={cache} moves each layer's cache from the GPU to the host between uses (CUDA "
                          "streams): it needs a GPU, and on the CPU the cache is in host memory already; use "
                          f"cache={'static' if cache == 'offloaded_static' else 'dynamic'}")


def _estimate(source, request: Request, precision: str, weights: str, progress) -> Report:
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    dtype = DTYPES[precision]
    if source.module is not None:
        model = fake_copy(source.module, mode, dtype)
    else:
        model = build_fake(source.build, mode, torch.device("cpu"), dtype)
    _check_generates(model, source.name)
    extra = quantize_weights(model, weights, dtype)
    config = model.config
    reads = KnownValues(max(LIMIT, 4 * request.batch_size * request.prompt_len))
    prompt = {}
    for name, value in prompt_batch(request, vocab_size(config)).items():
        prompt[name] = mode.from_tensor(value)
        reads.known(prompt[name], value)
    ledger = Ledger(device=torch.device("cpu"), model=model)
    ledger.on_phase = _ticker(progress, request.new_tokens + 1)
    ledger.probe_ops = PROBED
    for tensor in list(model.parameters()) + extra:
        ledger.register(tensor, Category.PARAMETERS)
    for tensor in model.buffers():
        ledger.register(tensor, Category.BUFFERS)
    for tensor in prompt.values():
        ledger.register(tensor, Category.BATCH)
    top_k = getattr(config.get_text_config(decoder=True), "num_experts_per_tok", None)
    with _as_real(), mode, Outliers(), CpuKernels(source.moe_routing, top_k), reads:
        _check_length(_traced(model, prompt, request, ledger, source.name), request, config)
        # inside CpuKernels: a mixture-of-experts kernel is replayed with the routing assumed
        scratch, unprobed = measure_scratch(ledger)
    return _report(ledger, (scratch, unprobed), model, request, precision, weights, reads, progress, source)


def _traced(model, prompt: dict, request: Request, ledger: Ledger, name: str):
    """``run_generate`` under ``ledger``; what fake tensors cannot run, or the model refuses, as one line."""
    try:
        with ledger:
            return run_generate(model, prompt, request, watch=ledger)
    except MemfitError:
        raise
    except (UnsupportedOperatorException, DataDependentOutputException, DynamicOutputShapeException,
            UnsupportedFakeTensorException) as err:
        op = getattr(err, "func", None) or str(err).splitlines()[0]
        raise MemfitError(f"operation {op} of {name}'s generate cannot run on fake tensors") from None
    except (RuntimeError, TypeError, ValueError, IndexError, KeyError, AttributeError, AssertionError,
            NotImplementedError) as err:
        raise MemfitError(f"{name}'s generate failed: {type(err).__name__}: {_first_line(err)}") from None
    finally:
        ledger.close()


def _report(ledger, probed, model, request: Request, precision, weights, reads, progress, source) -> Report:
    scratch, unprobed = probed
    result = replay(ledger, scratch)
    if progress is not None:
        progress(request.new_tokens + 1, request.new_tokens + 1)
    params = list(model.parameters())
    notes = [f"generate: greedy, exactly {request.new_tokens} new tokens (eos disabled), one beam"]
    if unprobed:
        notes.append(f"{unprobed} large op call(s) were not replayed for kernel scratch; their scratch is not counted")
    if reads.reads:
        notes.append(f"{reads.reads} scalar read(s) of values the fake run cannot know (derived from the weights) "
                     "were answered with a training step's default")
    if getattr(model.config.get_text_config(decoder=True), "num_experts_per_tok", None):
        notes.append(f"mixture of experts: {source.moe_routing} routing assumed (moe_routing=); it changes only CPU "
                     "bf16 kernel scratch")
    return Report(
        peak_bytes=result.peak_bytes,
        by_category=result.by_category,
        **fold_peaks(result.phase_peaks, request.new_tokens, GENERATE_PHASES),
        modules=result.modules,
        timeline=result.timeline,
        stacked=result.stacked,
        device="cpu",
        method="fake",
        modelled_bytes=result.scratch_at_peak,
        unprobed_ops=unprobed,
        parameters=sum(numel(p) for p in params),
        trainable=0,
        settings={"workload": "generate", "precision": precision, "weights": weights, "cache": request.cache,
                  "prompt_len": request.prompt_len, "new_tokens": request.new_tokens,
                  "batch_size": request.batch_size, "padding": request.padding,
                  "logits_to_keep": request.logits_to_keep, "steps": request.new_tokens,
                  "batch_shapes": [[request.batch_size, request.prompt_len]] * 2},
        notes=notes + list(source.notes),
    )


def _as_real():
    """transformers takes a fake tensor for a traced one (``is_tracing``: dynamo, torch.fx, fake tensors) and
    then skips what it reads, e.g. builds T5's encoder mask that a real run drops when nothing is padded.
    While the estimate runs a fake tensor is not one: the reads happen, answered by ``KnownValues``."""
    from transformers.utils import import_utils

    return patched(import_utils, "is_fake_tensor", lambda tensor: False)


def _check_generates(model, name: str) -> None:
    generate = getattr(model, "generate", None)
    can = getattr(model, "can_generate", None)
    if generate is None or getattr(model, "config", None) is None or (callable(can) and not can()):
        raise MemfitError(f"{name} ({type(model).__name__}) cannot generate: pass a causal LM or an encoder-decoder "
                          "model (a Hugging Face model with .generate)")


def _check_length(out, request: Request, config) -> None:
    """``generate`` made exactly the tokens asked (a stop the fake run read wrongly would make fewer)."""
    sequences = getattr(out, "sequences", out)
    start = 0 if config.is_encoder_decoder else request.prompt_len
    made = sequences.shape[-1] - start - (1 if config.is_encoder_decoder else 0)
    if made != request.new_tokens:
        raise MemfitError(f"generate stopped after {made} of {request.new_tokens} tokens on fake tensors: a stopping "
                          "rule read a value the fake run cannot know; the estimate would be too low")


def _ticker(progress, total: int):
    """``tick()`` for the ledger's ``on_phase``: ``progress(done, total)`` as each forward begins."""
    if progress is None:
        return None
    done = 0
    progress(done, total)

    def tick():
        nonlocal done
        done = min(done + 1, total - 1)  # the last step is the replay's
        progress(done, total)

    return tick


def _first_line(err: BaseException) -> str:
    return (str(err).strip() or type(err).__name__).splitlines()[0]
