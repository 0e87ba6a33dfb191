"""Van de Geijn broadcast: binomial scatter of blocks, then ring all-gather.

Moves about ``2 (n - 1) / n`` of the buffer per rank instead of ``log2 n`` copies of it:
the choice for large broadcasts.
"""
from __future__ import annotations

from typing import Any

from ..context import CommContext
from .binomial_schedule import tree_scatter
from .plans import rank_blocks, ring_plan
from .registry import register
from .ring_schedule import ring_allgather


@register("broadcast", "scatter_allgather")
def scatter_allgather_broadcast(ctx: CommContext, buf: Any, root: int) -> None:
    """Broadcast ``buf`` from ``root`` (blocks indexed by rank relative to the root)."""
    bounds = rank_blocks(ctx, buf.size)
    tree_scatter(ctx.p2p, ctx.rank, ctx.size, root, buf, bounds)
    plan = ring_plan(ctx, bounds, buf.dtype, buf, with_scratch=False)
    ring_allgather(ctx.p2p, ctx.rank, ctx.size, buf, plan.segb, shift=-root)
