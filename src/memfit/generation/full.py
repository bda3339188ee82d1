"""The full trace of a generation: every forward of a real Hugging Face ``generate`` on fake tensors under the
ledger (``estimate_generate`` with ``fast=False``, or where the fast path does not apply), and the pieces the
fast path (``fast.py``) shares with it: the traced ``generate`` call, the real-tensor escape for kernel
scratch, the check that a model generates.
"""

from __future__ import annotations

import contextlib
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
from memfit.errors import MemfitError
from memfit.estimator.fake import build_fake, fake_copy
from memfit.estimator.trace import fold_peaks, numel
from memfit.generation.run import Request, prompt_batch, run_generate, vocab_size
from memfit.generation.values import LIMIT, KnownValues
from memfit.generation.weights import DTYPES, Outliers, probed_ops, quantize_weights, stored
from memfit.generation.device import cuda_fields
from memfit.hardware.cpu_kernels import CpuKernels
from memfit.hardware.cuda import card_semantics
from memfit.report.report import Report
from memfit.scoped import patched

__all__ = ["estimate_full", "traced", "as_real", "check_generates", "register", "PROBED", "generation_ledger",
           "semantics"]

# CPU kernels whose scratch a generation's peak can sit on, replayed beside the training step's (conv, RNN,
# low-precision matmuls): SDPA's flash kernel allocates per-thread blocks inside itself (2,880 B per call of a
# tiny Llama's 12-token prefill on 2 threads), growing with the prompt and the threads.
PROBED = frozenset({"_scaled_dot_product_flash_attention_for_cpu"})


def estimate_full(source, request: Request, precision: str, weights: str, progress, gpu=None,
                  budget: int | None = None) -> Report:
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    dtype = DTYPES[precision]
    if source.module is not None:
        model = fake_copy(source.module, mode, dtype)
    else:
        model = build_fake(source.build, mode, torch.device("cpu"), dtype)
    check_generates(model, source.name)
    extra = quantize_weights(model, weights, dtype)
    config = model.config
    top_k = getattr(config.get_text_config(decoder=True), "num_experts_per_tok", None)
    reads = KnownValues(max(LIMIT, 4 * request.batch_size * request.prompt_len),
                        kernels=CpuKernels(source.moe_routing, top_k))  # in the mode: one mode less an op
    prompt = {}
    for name, value in prompt_batch(request, vocab_size(config)).items():
        prompt[name] = mode.from_tensor(value)
        reads.known(prompt[name], value)
    ledger = generation_ledger(model, weights, gpu)
    ledger.on_phase = _ticker(progress, request.new_tokens + 1)
    register(ledger, model, extra, prompt)
    with as_real(), mode, Outliers(), reads, semantics(gpu):
        _check_length(traced(model, prompt, request, ledger, source.name), request, config)
        # inside CpuKernels: a mixture-of-experts kernel is replayed with the routing assumed
        scratch, unprobed = measure_scratch(ledger)
    report = _report(ledger, (scratch, unprobed), model, request, precision, weights, reads, progress, source)
    if gpu is None:
        return report
    fields, notes = cuda_fields(ledger, gpu, budget)
    return dataclasses.replace(report, **fields, device="cuda", notes=report.notes + notes)


def generation_ledger(model, weights: str, gpu) -> Ledger:
    """The ledger of a generation's trace: on CUDA (``gpu`` a catalog card) with its cuBLAS workspace and no CPU
    kernel scratch, on the CPU with the kernels whose scratch is replayed."""
    if gpu is not None:
        ledger = Ledger(device=torch.device("cpu"), model=model, cublas_workspace=gpu.cublas_workspace_bytes)
        ledger.follow(gpu)
        return ledger
    ledger = Ledger(device=torch.device("cpu"), model=model)
    ledger.probe_ops = PROBED | probed_ops(weights)
    return ledger


def semantics(gpu):
    """CUDA's rules for the trace (``hardware/cuda.py``) when ``gpu`` is a card; nothing on the CPU."""
    return card_semantics(gpu) if gpu is not None else contextlib.nullcontext()


def traced(model, prompt: dict, request: Request, ledger: Ledger, name: str):
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


def as_real():
    """transformers takes a fake tensor for a traced one (``is_tracing``: dynamo, torch.fx, fake tensors) and
    then skips what it reads, e.g. builds T5's encoder mask that a real run drops when nothing is padded.
    While the estimate runs a fake tensor is not one: the reads happen, answered by ``KnownValues``."""
    from transformers.utils import import_utils

    return patched(import_utils, "is_fake_tensor", lambda tensor: False)


def check_generates(model, name: str) -> None:
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


def register(ledger, model, extra, prompt) -> None:
    """What exists before the generation: the weights (a quantised one's stored tensors, ``weights.stored``),
    the buffers and the prompt. Shared by the full trace and the fast path's traces."""
    for tensor in (local for t in list(model.parameters()) + extra for local in stored(t)):
        ledger.register(tensor, Category.PARAMETERS)
    for tensor in model.buffers():
        ledger.register(tensor, Category.BUFFERS)
    for tensor in prompt.values():
        ledger.register(tensor, Category.BATCH)


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
