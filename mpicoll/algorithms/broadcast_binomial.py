"""Binomial-tree broadcast, segmented so that large buffers pipeline down the tree."""
from __future__ import annotations

from typing import Any

from ..context import CommContext
from .binomial_schedule import tree_bcast
from .plans import tree_segments
from .registry import register


@register("broadcast", "binomial")
def binomial_broadcast(ctx: CommContext, buf: Any, root: int) -> None:
    """Broadcast ``buf`` from ``root``."""
    tree_bcast(ctx.p2p, ctx.rank, ctx.size, root, buf,
               tree_segments(ctx, buf.size, buf.dtype.itemsize))
