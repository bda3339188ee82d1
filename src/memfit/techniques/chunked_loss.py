"""Chunked loss: the language-model head and cross-entropy in pieces of the sequence.

Memory: the full ``batch x seq x vocab`` logits (and their fp32 upcast, softmax and gradient)
never exist at once; one chunk's do, during forward and again during backward. For a 128k
vocabulary at seq 2048 that is ~1 GiB per copy in fp32. Cost: the head's matmul runs twice
(each chunk is checkpointed and recomputed in backward).

Works for Hugging Face causal LMs (``get_output_embeddings`` + the base model); the loss is the
mean over predicted tokens, as ``model(**batch).loss`` computes it, so gradients match up to
summation order.

Does not combine with: a custom ``loss_fn`` (this *is* the loss function).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from memfit.errors import MemfitError, shown
from memfit.techniques.spec import Field, Technique

__all__ = ["chunked_lm_loss", "chunk_cross_entropy"]

IGNORE = -100


def chunk_cross_entropy(logits, labels):
    """One chunk's summed cross-entropy, its logits upcast to fp32 (what compile=layers compiles)."""
    logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")


def _chunk_loss(head, hidden, labels, cross_entropy):
    return cross_entropy(head(hidden), labels)


def chunked_lm_loss(chunks: int, *, cross_entropy=chunk_cross_entropy):
    """A ``loss_fn(model, batch)`` computing a causal-LM loss in ``chunks`` sequence pieces
    (``cross_entropy(logits, labels)`` per piece: ``chunk_cross_entropy`` or its compiled version)."""

    def loss_fn(model, batch):
        if hasattr(model, "get_base_model"):  # a peft wrapper: adapters live inside the HF model
            model = model.get_base_model()
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        base = getattr(model, "base_model", None)
        if head is None or base is None or base is model or "labels" not in batch:
            raise MemfitError("chunked_loss needs a Hugging Face causal LM and a batch with labels: "
                              "set chunked_loss=0 for this model")
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        hidden = base(**inputs).last_hidden_state[:, :-1]
        labels = batch["labels"][:, 1:]
        total = hidden.new_zeros((), dtype=torch.float32)
        for h, y in zip(hidden.chunk(chunks, dim=1), labels.chunk(chunks, dim=1)):
            total = total + checkpoint(_chunk_loss, head, h, y, cross_entropy, use_reentrant=False)
        return total / (labels != IGNORE).sum().clamp(min=1)

    return loss_fn


MAX_CHUNKS = 65536  # past this an estimate would trace for hours (every chunk runs)
SEARCH_CHUNKS = 8  # the chunk count the planner tries for a causal LM


def _check(value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or value == 1 or value > MAX_CHUNKS:
        raise MemfitError(f"chunked_loss must be 0 (off) or a number of chunks from 2 to {MAX_CHUNKS}, "
                          f"got {shown(value)}")


def _apply(build) -> None:
    chunks = build.recipe.chunked_loss
    if not chunks:
        return
    if build.user_loss:
        raise MemfitError("chunked_loss and loss_fn conflict: chunked_loss computes the loss itself; "
                          "drop loss_fn or set chunked_loss=0")
    build.loss_fn = chunked_lm_loss(chunks)


TECHNIQUE = Technique(
    name="chunked_loss",
    fields=(Field("chunked_loss", 0, "run the LM head + loss in N sequence chunks (0: off)", slot=50, kind="int",
                  check=_check),),
    order=40, apply=_apply, trace="graph",
    search=lambda ctx: [{"chunked_loss": n} for n in ((0, SEARCH_CHUNKS) if ctx.causal_lm else (0,))])
