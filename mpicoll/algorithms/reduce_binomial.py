"""Binomial-tree reduce to a root, segmented and pipelined."""
from __future__ import annotations

from typing import Any

from ..context import CommContext
from .binomial_schedule import tree_reduce
from .plans import scratch, tree_scratch, tree_segments
from .registry import register


@register("reduce", "binomial")
def binomial_reduce(ctx: CommContext, send: Any, recv: Any, op: Any, root: int) -> None:
    """Reduce every rank's ``send`` into ``recv`` on ``root`` (``recv`` unused elsewhere)."""
    segb = tree_segments(ctx, send.size, send.dtype.itemsize)
    slots = tree_scratch(ctx, root, segb, send.dtype, send)
    acc = recv if recv is not None else scratch(ctx, "vector", send.size, send.dtype, send)
    tree_reduce(ctx.p2p, ctx.rank, ctx.size, root, send, acc, segb, slots, op)
