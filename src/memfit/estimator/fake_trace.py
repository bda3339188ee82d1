"""``fake_trace``: one trace of a model's training steps on fake tensors.

The model is made fake (``fake.py``), the batch made or converted, and ``trace`` runs under
``FakeTensorMode`` with CPU kernel-scratch rules and scalar reads answered; what fake tensors
cannot run becomes one ``MemfitError`` line. ``estimate``, the depth fast path (``depth.py``) and
the planner's traces (``planner/compose.py``) all trace through here.
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

from memfit.errors import MemfitError, user_frame
from memfit.estimator.fake import ScalarReads, build_fake, fake_batch, fake_copy, quiet_fake_log
from memfit.estimator.trace import trace
from memfit.hardware.cpu_kernels import CpuKernels
from memfit.estimator.packing import PackedPositions
from memfit.models.lengths import positions, unread_masks
from memfit.models.mamba_scan import collapsed_scans
from memfit.models.source import Source
from memfit.techniques.compile import compile_scope
from memfit.techniques.precision import weight_dtype

__all__ = ["fake_trace"]


def fake_trace(source: Source, batch, *, recipe, loss_fn, optimizer, steps, batch_size, seq_len, gpu=None,
               detail: bool = False, prime: int | None = None, keep: bool = False, budget: int | None = None,
               tick=None, layout=None, placement=None, workload: str = "train"):
    """One full trace of ``source`` on fake tensors: (Report, replay); ``detail``, ``keep``, ``tick`` as for
    ``trace``; ``layout`` (a ``models.lengths.MicroBatch``): the made batch has micro-batches of that shape."""
    with quiet_fake_log(), compile_scope(recipe):
        return _fake_trace(source, batch, recipe=recipe, loss_fn=loss_fn, optimizer=optimizer, steps=steps,
                           batch_size=batch_size, seq_len=seq_len, gpu=gpu, detail=detail, prime=prime, keep=keep,
                           budget=budget, tick=tick, layout=layout, placement=placement, workload=workload)


def _fake_trace(source: Source, batch, *, recipe, loss_fn, optimizer, steps, batch_size, seq_len, gpu, detail, prime,
                keep, budget, tick, layout, placement, workload):
    device = torch.device("cpu")
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    dtype = weight_dtype(recipe.precision)
    if source.module is not None:
        module = fake_copy(source.module, mode, dtype)
    else:
        module = build_fake(source.build, mode, device, dtype)
    packing = PackedPositions()
    try:
        if batch is None:
            with mode:
                batch = source.make_batch(batch_size, seq_len, layout)
            if layout is not None and layout.packed:
                packing.remember(batch["position_ids"], positions(layout, batch_size // layout.rows))
        else:
            real = batch
            batch = fake_batch(batch, mode)
            if isinstance(batch, dict) and isinstance(batch.get("position_ids"), torch.Tensor):
                given = real.get("position_ids") if isinstance(real, dict) else None
                packing.remember(batch["position_ids"], given if isinstance(given, torch.Tensor) else None)
    except MemfitError:
        raise
    except Exception as err:  # noqa: BLE001 — a batch factory is the user's code
        where = user_frame(err)
        raise MemfitError(f"making the batch failed: {_overflow(err) or type(err).__name__ + ': ' + str(err)}"
                          f"{f' at {where}' if where else ''}: check the batch (or batch_size and seq_len)") from None
    if layout is not None and not layout.ragged and not layout.packed:
        unread_masks(module)
    config = source.config or getattr(module, "config", None)  # a factory's HF model carries its config
    top_k = getattr(getattr(config, "text_config", None) or config, "num_experts_per_tok", None)
    reads = ScalarReads(kernels=CpuKernels(source.moe_routing, top_k))
    with mode, reads, collapsed_scans(), packing:
        try:
            report, result = trace(module, batch, recipe=recipe, loss_fn=loss_fn, optimizer=optimizer,
                                   steps=steps, method="fake", gpu=gpu, detail=detail, prime=prime, keep=keep,
                                   budget=budget, tick=tick, placement=placement, workload=workload)
        except MemfitError:
            raise
        except (UnsupportedOperatorException, DataDependentOutputException,
                DynamicOutputShapeException, UnsupportedFakeTensorException) as err:
            op = getattr(err, "func", None) or str(err).splitlines()[0]
            raise MemfitError(f"operation {op} cannot run on fake tensors: run the step for real with "
                              "memfit.measure(...) instead") from None
        except (RuntimeError, TypeError, ValueError, IndexError, KeyError, OverflowError) as err:
            if _overflow(err):
                raise MemfitError(f"{_overflow(err)}: use a smaller batch_size or seq_len") from None
            hint = ""
            if "same dtype" in str(err) and recipe.precision in ("bf16", "fp16"):
                hint = (f": precision={recipe.precision} casts the model, not the batch; pass the batch in that dtype, "
                        "or use bf16-mixed")
            where = user_frame(err)
            if where is not None:  # the user's own code raised (their loss function, their model class): where
                raise MemfitError(f"the step raised {type(err).__name__} at {where}: {_first_line(err)}{hint}: fix "
                                  "the code there (the model, the batch or the loss function)") from None
            raise MemfitError(f"the model rejected the batch: {_first_line(err)}{hint}") from None
    notes = []  # what only the fake run knows, after the trace: the Report is made anew with them
    if top_k and recipe.ep > 1:
        notes.append(f"mixture of experts over ep={recipe.ep}: {source.moe_routing} routing assumed (moe_routing=): "
                     "it sets how many (token, expert) pairs reach each rank's experts through the all-to-all "
                     + ("(worst: every token of every rank on EP rank 0's experts)" if source.moe_routing == "worst"
                        else "(balanced: each rank receives as many as it sends; --moe-routing worst for the bound)"))
    elif top_k:
        notes.append(f"mixture of experts: {source.moe_routing} routing assumed (moe_routing=); it changes "
                     "only CPU bf16 kernel scratch, every expert tensor is tokens x top_k")
    if recipe.compile and gpu is not None:
        notes.append("compile: Inductor's plan for the CPU (C++ kernels) under CUDA semantics; CUDA's Triton "
                     "kernels fuse and reuse buffers by the same scheduler, not checked on a GPU")
    if packing.unknown:
        notes.append(f"{packing.unknown} packed-sequence check(s) of the batch's position_ids had no values to read "
                     "(a batch made on fake tensors) and were answered 'not packed': pass a real batch")
    if reads.reads:
        notes.append(f"{reads.reads} scalar read(s) of fake tensors (.item()) were answered with 0")
    if notes:
        report = dataclasses.replace(report, notes=report.notes + notes)
    return report, result


def _overflow(err: BaseException) -> str | None:
    """A sentence when ``err`` is a size that overflows 64 bits, else None."""
    text = str(err)
    if isinstance(err, OverflowError) or "overflow" in text.lower() or "negative dimension" in text:
        return "the step's tensor sizes overflow 64-bit byte counts"
    return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]
