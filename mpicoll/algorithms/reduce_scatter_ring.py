"""Ring reduce-scatter: rank ``i`` ends with block ``i`` reduced, in ``n - 1`` segmented steps."""
from __future__ import annotations

from typing import Any

from ..context import CommContext
from .plans import rank_blocks, ring_plan, scratch
from .registry import register
from .ring_schedule import ring_reduce_scatter


@register("reduce_scatter", "ring")
def ring_reduce_scatter_blocks(ctx: CommContext, send: Any, recv: Any, op: Any) -> None:
    """Reduce-scatter the full vector ``send``; this rank's block lands in ``recv``."""
    bounds = rank_blocks(ctx, send.size)
    plan = ring_plan(ctx, bounds, send.dtype, send)
    work = scratch(ctx, "vector", send.size, send.dtype, send)
    ring_reduce_scatter(ctx.p2p, ctx.rank, ctx.size, send, work, plan.segb, plan.scratch, op,
                        shift=-1, final=recv, final_offset=bounds[ctx.rank])
