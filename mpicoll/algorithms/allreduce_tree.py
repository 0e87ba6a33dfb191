"""Binomial-tree all-reduce: segmented binomial reduce to rank 0, then binomial broadcast.

Segments pipeline through the tree, so large buffers keep every level busy; small
buffers take ``2 ceil(log2 n)`` steps.
"""
from __future__ import annotations

from typing import Any

from ..context import CommContext
from .binomial_schedule import tree_bcast, tree_reduce
from .plans import tree_scratch, tree_segments
from .registry import register


@register("allreduce", "tree")
def tree_allreduce(ctx: CommContext, send: Any, recv: Any, op: Any) -> None:
    """All-reduce ``send`` into ``recv``: reduce to rank 0, broadcast back."""
    segb = tree_segments(ctx, recv.size, recv.dtype.itemsize)
    slots = tree_scratch(ctx, 0, segb, recv.dtype, recv)
    tree_reduce(ctx.p2p, ctx.rank, ctx.size, 0, send, recv, segb, slots, op)
    tree_bcast(ctx.p2p, ctx.rank, ctx.size, 0, recv, segb)
