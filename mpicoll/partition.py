"""Chunk arithmetic shared by every algorithm: block bounds, segments, tree and fold maps.

Blocks follow ``numpy.array_split``: ``count`` elements in ``n`` blocks gives ``count // n``
elements per block and one more for the first ``count % n`` blocks.
"""
from __future__ import annotations

from itertools import groupby

__all__ = ["block_bounds", "segment_count", "segment_bounds", "lowbit", "tree_parent",
           "tree_children", "subtree_size", "Fold", "rank_ranges", "is_power_of_two"]


def block_bounds(count: int, nblocks: int) -> list[int]:
    """Offsets ``[o_0 = 0, o_1, ..., o_n = count]`` of ``nblocks`` array_split blocks."""
    if nblocks <= 0:
        raise ValueError(f"nblocks must be positive, got {nblocks}")
    base, extra = divmod(count, nblocks)
    return [i * base + min(i, extra) for i in range(nblocks + 1)]


def segment_count(largest_block: int, itemsize: int, segment_bytes: int) -> int:
    """How many segments split the largest block so none exceeds ``segment_bytes``."""
    per = max(1, segment_bytes // max(1, itemsize))
    return max(1, -(-largest_block // per))


def segment_bounds(lo: int, hi: int, nseg: int) -> list[int]:
    """Offsets of ``nseg`` array_split segments of the range ``[lo, hi)``."""
    return [lo + b for b in block_bounds(hi - lo, nseg)]


def is_power_of_two(n: int) -> bool:
    """Whether ``n`` is 1, 2, 4, 8, ..."""
    return n > 0 and n & (n - 1) == 0


def lowbit(v: int) -> int:
    """Lowest set bit of ``v`` (``v > 0``)."""
    return v & -v


def tree_parent(vrank: int) -> int:
    """Parent of relative rank ``vrank > 0`` in the binomial tree rooted at 0."""
    return vrank - lowbit(vrank)


def tree_children(vrank: int, size: int) -> list[int]:
    """Children of ``vrank`` in the binomial tree rooted at 0, nearest first."""
    limit = lowbit(vrank) if vrank else 1 << max(0, (size - 1).bit_length())
    masks = [1 << i for i in range(limit.bit_length() - 1)]   # 1, 2, 4, ... below limit
    return [vrank + mask for mask in masks if vrank + mask < size]


def subtree_size(vrank: int, size: int) -> int:
    """Number of ranks in the binomial subtree rooted at ``vrank``."""
    if vrank == 0:
        return size
    return min(lowbit(vrank), size - vrank)


class Fold:
    """Folding of a non-power-of-two group into ``p`` participants (MPICH's scheme).

    With ``p`` the largest power of two <= ``size`` and ``rem = size - p``, the first
    ``2 * rem`` ranks pair up: each even rank hands its data to the odd rank above it and
    sits out; participant ``j`` is rank ``2j + 1`` for ``j < rem`` and ``j + rem`` after.
    Participant ``j`` stands for original ranks ``first(j) .. first(j + 1) - 1``.
    """

    def __init__(self, rank: int, size: int) -> None:
        self.size = size
        self.p = 1 << (size.bit_length() - 1)
        self.rem = size - self.p
        self.rank = rank
        if rank < 2 * self.rem:
            self.newrank = rank // 2 if rank % 2 else -1
            self.partner = rank - 1 if rank % 2 else rank + 1
        else:
            self.newrank = rank - self.rem
            self.partner = -1

    @property
    def folded(self) -> bool:
        """Whether this rank is one of the first ``2 * rem`` (exchanges with ``partner``)."""
        return self.partner >= 0

    def real(self, newrank: int) -> int:
        """Rank of participant ``newrank``."""
        return 2 * newrank + 1 if newrank < self.rem else newrank + self.rem

    def first(self, newrank: int) -> int:
        """First original rank participant ``newrank`` stands for (``first(p) == size``)."""
        return 2 * newrank if newrank < self.rem else newrank + self.rem


def rank_ranges(ranks: list[int]) -> str:
    """``ranks`` with runs of consecutive ranks as spans: ``[0, 2, 4, 5, 6, 7]`` ->
    ``"0,2,4-7"``."""
    spans = []
    for _, run in groupby(enumerate(ranks), lambda p: p[1] - p[0]):   # r - i: one per run
        run = [r for _, r in run]
        spans.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(spans)
