"""Plans shared by the algorithms: derived once per (communicator, count, dtype) and cached.

A plan holds what does not change between calls with the same shape: block and segment
offsets, the fold map, and scratch buffers (allocated through :mod:`mpicoll.buffers`, on
the device of the arrays being reduced).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import buffers
from ..context import CommContext
from ..partition import Fold, block_bounds, segment_bounds, segment_count, tree_children

__all__ = ["RingPlan", "ring_plan", "scratch", "fold", "tree_segments", "tree_scratch"]


@dataclass
class RingPlan:
    """Block offsets, per-block segment offsets and two receive buffers for a ring."""

    bounds: list[int]
    segb: list[list[int]]
    scratch: list[Any]


def ring_plan(ctx: CommContext, bounds: list[int], dtype: Any, like: Any,
              with_scratch: bool = True) -> RingPlan:
    """The ring plan for blocks ``bounds`` (one block per rank) of ``dtype``."""
    key = ("ring", tuple(bounds), dtype, buffers.package_of(like), ctx.segment_bytes, with_scratch)

    def build() -> RingPlan:
        largest = max(bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1))
        nseg = segment_count(largest, dtype.itemsize, ctx.segment_bytes)
        segb = [segment_bounds(bounds[b], bounds[b + 1], nseg) for b in range(len(bounds) - 1)]
        width = -(-largest // nseg)
        bufs = [buffers.empty(width, dtype, like) for _ in range(2)] if with_scratch else []
        return RingPlan(bounds, segb, bufs)

    return ctx.plan(key, build)


def scratch(ctx: CommContext, purpose: str, count: int, dtype: Any, like: Any) -> Any:
    """A cached scratch array of ``count`` elements, one per ``purpose``."""
    key = ("scratch", purpose, count, dtype, buffers.package_of(like))
    return ctx.plan(key, lambda: buffers.empty(count, dtype, like))


def fold(ctx: CommContext) -> Fold:
    """The non-power-of-two fold map of this communicator."""
    return ctx.plan(("fold",), lambda: Fold(ctx.rank, ctx.size))


def tree_segments(ctx: CommContext, count: int, itemsize: int) -> list[int]:
    """Segment offsets of a whole ``count``-element buffer for the tree algorithms."""
    key = ("tree_segments", count, itemsize, ctx.segment_bytes)
    return ctx.plan(key, lambda: segment_bounds(
        0, count, segment_count(count, itemsize, ctx.segment_bytes)))


def tree_scratch(ctx: CommContext, root: int, segb: list[int], dtype: Any,
                 like: Any) -> list[list[Any]]:
    """Two slots of one segment buffer per child of this rank in the tree rooted at ``root``."""
    nchildren = len(tree_children((ctx.rank - root) % ctx.size, ctx.size))
    width = max((segb[j + 1] - segb[j] for j in range(len(segb) - 1)), default=0)
    key = ("tree_scratch", nchildren, width, dtype, buffers.package_of(like))
    return ctx.plan(key, lambda: [[buffers.empty(width, dtype, like)
                                   for _ in range(nchildren)] for _ in range(2)])


def rank_blocks(ctx: CommContext, count: int) -> list[int]:
    """``array_split`` block offsets of ``count`` elements over the ranks."""
    return ctx.plan(("blocks", count), lambda: block_bounds(count, ctx.size))
