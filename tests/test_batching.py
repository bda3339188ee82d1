"""Memory-sized micro-batches: every micro-batch fits, each example lands once, fewer padded
tokens than fixed rows sized for the longest, and packing keeps rows within seq_len."""

import random

import pytest

from memfit import MemfitError
from memfit.training.batching import micro_batches, pack, padded_tokens


def _fits(limit):
    # a monotone stand-in for a predicted peak: fixed cost plus activations per token
    return lambda rows, length: 1000 + rows * length * 3 <= limit


def _lengths(n, seed=0):
    rng = random.Random(seed)
    return [min(2048, int(rng.paretovariate(1.2) * 40)) for _ in range(n)]  # long-tailed


def test_every_example_once_and_every_micro_batch_fits():
    lengths, fits = _lengths(256), _fits(1000 + 3 * 8192)
    groups = micro_batches(lengths, fits)
    ids = [i for g in groups for row in g for i in row]
    assert sorted(ids) == list(range(256))
    longest = [max(lengths[i] for row in g for i in row) for g in groups]
    assert longest == sorted(longest)  # shortest rows first
    for k, g in enumerate(groups):
        assert fits(len(g), longest[k])
        if k + 1 < len(groups):  # full: the next row would not have fitted
            assert not fits(len(g) + 1, lengths[groups[k + 1][0][0]])


def test_fewer_padded_tokens_than_fixed_rows_for_the_longest():
    lengths = _lengths(512, seed=1)
    limit = 1000 + 3 * 8192
    groups = micro_batches(lengths, _fits(limit))
    longest = max(lengths)
    fixed_rows = max(r for r in range(1, 512) if _fits(limit)(r, longest))
    fixed = -(-len(lengths) // fixed_rows) * fixed_rows * longest  # padded to the longest, full micro-batches
    assert padded_tokens(groups, lengths) < fixed / 2
    assert len(groups) < -(-len(lengths) // fixed_rows)


def test_packing_rows_within_seq_len():
    lengths = _lengths(200, seed=2)
    rows = pack(lengths, 2048)
    assert sorted(i for r in rows for i in r) == list(range(200))
    assert all(sum(lengths[i] for i in r) <= 2048 for r in rows)
    assert len(rows) <= sum(lengths) // 2048 + 2  # first-fit decreasing is near the bound here
    groups = micro_batches(lengths, _fits(1000 + 3 * 4096), seq_len=2048)
    assert all(len(g) <= 2 for g in groups) and sum(len(g) for g in groups) == len(rows)


def test_a_row_that_cannot_fit_is_one_line():
    with pytest.raises(MemfitError, match="does not fit the budget on its own"):
        micro_batches([10, 5000], _fits(1000 + 3 * 4096))
    with pytest.raises(MemfitError, match="raise --seq-len"):
        pack([10, 5000], 4096)
