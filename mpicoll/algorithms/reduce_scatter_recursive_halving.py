"""Recursive-halving reduce-scatter (folded for non-powers of two)."""
from __future__ import annotations

from typing import Any

from .. import buffers, waiting
from ..buffers import msg
from ..context import CommContext
from .halving_doubling_schedule import TAG_FOLD, fold_in, halving_reduce_scatter
from .plans import fold, rank_blocks, scratch
from .registry import register


@register("reduce_scatter", "recursive_halving")
def halving_reduce_scatter_blocks(ctx: CommContext, send: Any, recv: Any, op: Any) -> None:
    """Reduce-scatter the full vector ``send``; this rank's block lands in ``recv``."""
    f = fold(ctx)
    bounds = rank_blocks(ctx, send.size)
    groups = ctx.plan(("rs_groups", send.size),
                      lambda: [bounds[f.first(j)] for j in range(f.p + 1)])
    work = scratch(ctx, "vector", send.size, send.dtype, send)
    tmp = scratch(ctx, "vector2", send.size, send.dtype, send)
    mine = slice(bounds[ctx.rank], bounds[ctx.rank + 1])
    cur = fold_in(ctx.p2p, f, send, work, tmp, op)
    if f.newrank < 0:
        waiting.recv(ctx.p2p, msg(recv), f.partner, TAG_FOLD)
        return
    cur = halving_reduce_scatter(ctx.p2p, f, cur, work, groups, tmp, op)
    if f.folded:
        waiting.send(ctx.p2p, msg(cur[bounds[f.partner]:bounds[f.partner + 1]]), f.partner,
                     TAG_FOLD)
    buffers.copy(recv, cur[mine])
