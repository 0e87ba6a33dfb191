"""Ring all-reduce: ring reduce-scatter followed by ring all-gather, segmented.

Bandwidth-optimal (each rank sends ``2 (n - 1) / n`` of the vector) and the best choice for
large messages; ``2 (n - 1) * nseg`` message steps make it slow for small ones.
"""
from __future__ import annotations

from typing import Any

from ..context import CommContext
from .plans import rank_blocks, ring_plan
from .registry import register
from .ring_schedule import ring_allgather, ring_reduce_scatter


@register("allreduce", "ring")
def ring_allreduce(ctx: CommContext, send: Any, recv: Any, op: Any) -> None:
    """All-reduce ``send`` into ``recv`` over a ring (``send is recv``: in place)."""
    plan = ring_plan(ctx, rank_blocks(ctx, recv.size), recv.dtype, recv)
    ring_reduce_scatter(ctx.p2p, ctx.rank, ctx.size, send, recv, plan.segb, plan.scratch, op)
    ring_allgather(ctx.p2p, ctx.rank, ctx.size, recv, plan.segb, shift=1)
