"""The micro-batch shapes of variable-length data that an estimate traces, and the note naming them.

With ``lengths`` (per-example token counts) or ``packed`` rows, every micro-batch of a step has its own
shape; the estimate traces the few that can be the worst (``models/lengths.worst_shapes``) and reports
the one with the highest peak, saying which it is and what mask transformers builds for it.
"""

from __future__ import annotations

from memfit.errors import MemfitError
from memfit.techniques.recipe import Recipe

__all__ = ["worst_shapes", "shape_note"]


def worst_shapes(source, batch, lengths, packed: bool, recipe: Recipe, batch_size: int, seq_len):
    """The micro-batch shapes of ``lengths`` one of which is the worst (``lengths.worst_shapes``)."""
    from memfit.models.lengths import MicroBatch, direct, micro_batches, read_lengths, worst_shapes as worst

    if isinstance(lengths, MicroBatch):  # estimate_micro_batch's shape
        return [lengths]
    if batch is not None:
        raise MemfitError("lengths= and packed= make the batch: drop batch=, or pass your own padded or packed batch "
                          "without them")
    rows, rest = divmod(batch_size, recipe.grad_accum_steps)
    if rest:
        raise MemfitError(f"grad_accum_steps={recipe.grad_accum_steps} does not divide batch_size={batch_size}: "
                          "pick a divisor")
    if lengths is None:  # packed rows, each of two documents
        if seq_len is None:
            raise MemfitError("packed=True needs seq_len: the tokens of one packed row")
        return [direct(rows, seq_len, True, True)]
    return worst(micro_batches(read_lengths(lengths), rows, packed=packed, seq_len=seq_len))


def shape_note(shape) -> str:
    """The report's note on the micro-batch shape it traced: which, how many rows and tokens, what mask."""
    kind = "packed" if shape.packed else "padded"
    where = (f"micro-batch {shape.index + 1} of {shape.count}, the worst the lengths make: "
             if shape.index is not None else "")
    mask = (("rows of two or more documents: transformers builds a block-causal mask per forward"
             if shape.packed else "padding: transformers builds a 4-D mask per forward")
            if shape.ragged else "no padding or document boundary: runs as a dense batch, no mask")
    tokens = f", {shape.tokens:,} real tokens" if shape.tokens is not None else ""
    return f"{where}{shape.rows} {kind} row(s) of {shape.length} tokens{tokens}; {mask}"
