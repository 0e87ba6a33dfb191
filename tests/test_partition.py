"""Serial tests of chunk arithmetic, tree maps and the non-power-of-two fold."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpicoll.partition import (Fold, block_bounds, segment_bounds, segment_count,
                               subtree_size, tree_children, tree_parent)


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_block_bounds_match_array_split(count, n):
    bounds = block_bounds(count, n)
    sizes = [len(b) for b in np.array_split(np.arange(count), n)]
    assert np.diff(bounds).tolist() == sizes
    assert bounds[0] == 0 and bounds[-1] == count


@given(st.integers(0, 10_000), st.integers(1, 16), st.integers(1, 4096))
def test_segments_cover_block_within_limit(largest, itemsize, seg_bytes):
    nseg = segment_count(largest, itemsize, seg_bytes)
    segs = segment_bounds(5, 5 + largest, nseg)
    widths = np.diff(segs)
    assert segs[0] == 5 and segs[-1] == 5 + largest
    assert widths.max(initial=0) * itemsize <= max(seg_bytes, itemsize)


@given(st.integers(1, 300))
def test_binomial_tree_is_a_spanning_tree(size):
    seen = {0}
    for v in range(size):
        for c in tree_children(v, size):
            assert tree_parent(c) == v
            assert c not in seen
            seen.add(c)
    assert seen == set(range(size))
    # subtree sizes are consistent with children
    for v in range(size):
        assert subtree_size(v, size) == 1 + sum(subtree_size(c, size)
                                                for c in tree_children(v, size))


@given(st.integers(1, 300))
def test_fold_maps_participants(size):
    folds = [Fold(r, size) for r in range(size)]
    p = folds[0].p
    assert p & (p - 1) == 0 and p <= size < 2 * p
    participants = sorted(f.newrank for f in folds if f.newrank >= 0)
    assert participants == list(range(p))
    for f in folds:
        if f.newrank >= 0:
            assert f.real(f.newrank) == f.rank
        if f.folded:
            assert folds[f.partner].partner == f.rank
    firsts = [folds[0].first(j) for j in range(p + 1)]
    assert firsts[0] == 0 and firsts[-1] == size and firsts == sorted(set(firsts))


def test_block_bounds_refuses_no_blocks():
    """Zero or negative blocks raise ValueError naming the count (not a division error)."""
    for n in (0, -1):
        with pytest.raises(ValueError, match=f"nblocks must be positive, got {n}"):
            block_bounds(10, n)
