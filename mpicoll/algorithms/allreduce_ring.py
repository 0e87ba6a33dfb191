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


@register("allreduce", "ring", scales_shards=True)
def ring_allreduce(ctx: CommContext, send: Any, recv: Any, op: Any, *,
                   finalize: bool = False) -> None:
    """All-reduce ``send`` into ``recv`` over a ring (``send is recv``: in place).

    ``finalize``: apply ``op.finalize`` to this rank's reduced block before the all-gather.
    """
    bounds = rank_blocks(ctx, recv.size)
    plan = ring_plan(ctx, bounds, recv.dtype, recv)
    ring_reduce_scatter(ctx.p2p, ctx.rank, ctx.size, send, recv, plan.segb, plan.scratch, op)
    if finalize:
        mine = (ctx.rank + 1) % ctx.size
        op.finalize(recv[bounds[mine]:bounds[mine + 1]], ctx.size)
    ring_allgather(ctx.p2p, ctx.rank, ctx.size, recv, plan.segb, shift=1)
