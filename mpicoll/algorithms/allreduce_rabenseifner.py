"""Rabenseifner's all-reduce: recursive-halving reduce-scatter + recursive-doubling all-gather.

Bandwidth-optimal like the ring but in ``2 log2(p)`` steps: good for medium and large
messages, especially at world sizes that are powers of two.
"""
from __future__ import annotations

from typing import Any

from ..context import CommContext
from ..partition import block_bounds
from .halving_doubling_schedule import doubling_allgather, fold_in, fold_out, halving_reduce_scatter
from .plans import fold, scratch
from .registry import register


@register("allreduce", "rabenseifner", scales_shards=True)
def rabenseifner_allreduce(ctx: CommContext, send: Any, recv: Any, op: Any, *,
                           finalize: bool = False) -> None:
    """All-reduce ``send`` into ``recv`` with Rabenseifner's algorithm.

    ``finalize``: apply ``op.finalize`` to this rank's reduced group before the all-gather.
    """
    f = fold(ctx)
    count = recv.size
    groups = ctx.plan(("groups", count, f.p), lambda: block_bounds(count, f.p))
    tmp = scratch(ctx, "vector", count, recv.dtype, recv)
    cur = fold_in(ctx.p2p, f, send, recv, tmp, op)
    if f.newrank >= 0:
        halving_reduce_scatter(ctx.p2p, f, cur, recv, groups, tmp, op)
        if finalize:
            op.finalize(recv[groups[f.newrank]:groups[f.newrank + 1]], ctx.size)
        doubling_allgather(ctx.p2p, f, recv, groups)
    fold_out(ctx.p2p, f, recv)
