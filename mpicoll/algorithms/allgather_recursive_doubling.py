"""Recursive-doubling all-gather (folded for non-powers of two)."""
from __future__ import annotations

from typing import Any

from .. import buffers, waiting
from ..buffers import msg
from ..context import CommContext
from .halving_doubling_schedule import TAG_FOLD, doubling_allgather, fold_out
from .plans import fold
from .registry import register


@register("allgather", "recursive_doubling")
def recursive_doubling_allgather(ctx: CommContext, send: Any, recv: Any) -> None:
    """Gather every rank's block into ``recv`` (``send=None``: already in place)."""
    f = fold(ctx)
    block = recv.size // ctx.size
    groups = ctx.plan(("ag_groups", recv.size),
                      lambda: [f.first(j) * block for j in range(f.p + 1)])
    mine = recv[ctx.rank * block:(ctx.rank + 1) * block]
    if send is not None:
        buffers.copy(mine, send)
    if f.folded:
        if f.newrank < 0:
            waiting.send(ctx.p2p, msg(mine), f.partner, TAG_FOLD)
        else:
            other = recv[f.partner * block:(f.partner + 1) * block]
            waiting.recv(ctx.p2p, msg(other), f.partner, TAG_FOLD)
    if f.newrank >= 0:
        doubling_allgather(ctx.p2p, f, recv, groups)
    fold_out(ctx.p2p, f, recv)
