"""Recursive-doubling all-reduce: log2(p) exchanges of the whole vector.

Fewest message steps (plus two for a non-power-of-two fold): the choice for small
messages. Sends ``log2(p)`` whole vectors per rank, so poor for large ones.
"""
from __future__ import annotations

from typing import Any

from ..context import CommContext
from .halving_doubling_schedule import doubling_allreduce, fold_in, fold_out
from .plans import fold, scratch
from .registry import register


@register("allreduce", "recursive_doubling")
def recursive_doubling_allreduce(ctx: CommContext, send: Any, recv: Any, op: Any) -> None:
    """All-reduce ``send`` into ``recv`` by recursive doubling."""
    f = fold(ctx)
    tmp = scratch(ctx, "vector", recv.size, recv.dtype, recv)
    cur = fold_in(ctx.p2p, f, send, recv, tmp, op)
    if f.newrank >= 0:
        doubling_allreduce(ctx.p2p, f, cur, recv, tmp, op)
    fold_out(ctx.p2p, f, recv)
