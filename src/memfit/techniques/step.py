"""The pieces of a training step that every recipe shares: the default loss, batch handling,
micro-batch splitting and the weights that make accumulated gradients equal full-batch ones.

The step itself is composed in ``apply.py``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from memfit.errors import MemfitError

__all__ = ["default_loss", "batch_tensors", "check_loss", "split_batch", "token_weights", "label_counts", "IGNORE_INDEX"]

IGNORE_INDEX = -100  # Hugging Face's label for "no loss here"


def default_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    """Hugging Face style: ``model(**batch).loss``."""
    if not isinstance(batch, Mapping):
        raise MemfitError(
            "the batch is not a dict, so memfit cannot guess the loss: pass "
            "loss_fn=lambda model, batch: ... returning a scalar loss"
        )
    out = model(**batch)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if loss is None:
        raise MemfitError("the model returned no loss: add labels to the batch or pass loss_fn")
    return loss


def batch_tensors(batch) -> list[torch.Tensor]:
    """Every tensor in a tensor, tuple/list or dict batch."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        return [t for item in batch for t in batch_tensors(item)]
    return []


def check_loss(loss) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise MemfitError(f"loss_fn must return a scalar tensor, got {shape}: reduce it, e.g. .mean()")
    if not loss.requires_grad:
        raise MemfitError("the loss does not require grad: check that the model has trainable parameters in use")


def batch_rows(batch) -> int:
    tensors = batch_tensors(batch)
    if not tensors or tensors[0].dim() == 0:
        raise MemfitError("cannot split a batch with no batch dimension: set grad_accum_steps=1")
    return tensors[0].shape[0]


def batch_slice(batch, start: int, stop: int):
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, Mapping):
        return {k: batch_slice(v, start, stop) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(batch_slice(v, start, stop) for v in batch)
    return batch


def split_batch(batch, parts: int, micro_batch_size: int | None = None) -> list:
    """``batch`` cut along dim 0 into ``parts`` micro-batches (views, no copies)."""
    if parts == 1 and micro_batch_size is None:
        return [batch]
    rows = batch_rows(batch)
    if micro_batch_size is not None and micro_batch_size * parts != rows:
        raise MemfitError(f"micro_batch_size={micro_batch_size} x grad_accum_steps={parts} must equal the "
                          f"batch's {rows} rows: change one of them or the batch")
    if rows % parts:
        raise MemfitError(f"grad_accum_steps={parts} does not divide the batch's {rows} rows: pick a divisor")
    size = rows // parts
    return [batch_slice(batch, i * size, (i + 1) * size) for i in range(parts)]


def _causal(model) -> bool:
    inner = getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model
    return type(inner).__name__.endswith(("ForCausalLM", "LMHeadModel"))


def label_counts(model, micro: list) -> list | None:
    """Each micro-batch's tokens that carry a label (shifted by one for causal LMs), as tensors; None
    when a micro-batch has no ``labels`` (its loss is then a mean over examples)."""
    labels = [m.get("labels") if isinstance(m, Mapping) else None for m in micro]
    if any(y is None or y.dim() < 2 for y in labels):
        return None
    if _causal(model):
        labels = [y[:, 1:] for y in labels]
    return [(y != IGNORE_INDEX).sum() for y in labels]


def token_weights(model, micro: list) -> list:
    """Per-micro-batch loss weights so the accumulated gradient is the full batch's.

    Hugging Face losses are means over the tokens that have a label, so a micro-batch's loss is
    weighted by its share of those tokens (shifted by one for causal LMs); any other loss is a
    mean over examples and gets ``1 / parts``. Weights are tensors: no value is read, so the same
    code runs on fake tensors.
    """
    counts = label_counts(model, micro)
    if counts is None:
        return [1.0 / len(micro)] * len(micro)
    total = sum(counts[1:], counts[0])
    return [count / total for count in counts]
