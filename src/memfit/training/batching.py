"""Micro-batches formed by their memory, not by a fixed row count.

A global batch of variable-length examples is cut into micro-batches whose predicted peak fits:
the examples are sorted by length (length grouping: rows of a micro-batch have similar lengths, so
little padding), then each micro-batch takes rows while ``fits(rows, longest)`` holds. A long
micro-batch gets few rows and short ones many, instead of every micro-batch being sized for the
longest sequence of the dataset. With ``seq_len`` given, documents are packed into rows of that
many tokens first (first-fit decreasing) and the rows are grouped the same way.

``fits`` must be monotone (more rows or longer rows never need less memory); then cutting the
sorted list greedily gives the fewest micro-batches of any cut into runs of the sorted order.
After an out-of-memory error the caller asks again with a stricter ``fits`` (a smaller budget);
the global batch, and so the update, stays the same. Losses are weighted by tokens
(``techniques/step.py``), so the sum over micro-batches equals the unsplit batch's loss.

Why by hand: torch's and Hugging Face's samplers group by length but size batches in rows; none
sizes them by memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from memfit.errors import MemfitError

__all__ = ["micro_batches", "pack", "padded_tokens"]


def pack(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Documents (their indices) packed into rows of at most ``seq_len`` tokens, first-fit decreasing."""
    if seq_len < 1:
        raise MemfitError(f"seq_len must be positive to pack, got {seq_len}")
    too_long = [i for i, n in enumerate(lengths) if n > seq_len]
    if too_long:
        raise MemfitError(f"example {too_long[0]} has {lengths[too_long[0]]} tokens, more than a packed row of "
                          f"{seq_len}: raise --seq-len or cut the examples")
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(seq_len - lengths[i])
    return rows


def micro_batches(lengths: Sequence[int], fits: Callable[[int, int], bool], *,
                  seq_len: int | None = None) -> list[list[list[int]]]:
    """Each micro-batch as its rows, each row the examples (indices into ``lengths``) it holds:
    one example per row, or with ``seq_len`` the documents packed into it. Shortest rows first.

    fits      ``fits(rows, length)``: whether ``rows`` rows padded to ``length`` tokens fit
    seq_len   pack documents into rows of this many tokens first (a packed row is ``seq_len`` long)
    """
    if not len(lengths):
        return []
    if seq_len is not None:
        rows = pack(lengths, seq_len)
        row_len = [seq_len] * len(rows)
    else:
        rows = [[i] for i in range(len(lengths))]
        row_len = [int(n) for n in lengths]
    order = sorted(range(len(rows)), key=lambda r: (row_len[r], r))
    out, current, longest = [], [], 0
    for r in order:
        length = max(longest, row_len[r])
        if current and fits(len(current) + 1, length):
            current.append(r)
            longest = length
            continue
        if current:
            out.append(current)
        if not fits(1, row_len[r]):
            raise MemfitError(f"one row of {row_len[r]} tokens does not fit the budget on its own: shorten the "
                              "sequences, raise the budget, or use a recipe that saves more memory")
        current, longest = [r], row_len[r]
    out.append(current)
    return [[rows[r] for r in group] for group in out]


def padded_tokens(groups: list[list[list[int]]], lengths: Sequence[int], seq_len: int | None = None) -> int:
    """Tokens the micro-batches compute, padding included: rows x longest row, per micro-batch
    (a packed row is ``seq_len`` long)."""
    def row(docs):
        return seq_len if seq_len is not None else sum(lengths[i] for i in docs)

    return sum(len(g) * max(row(r) for r in g) for g in groups)
