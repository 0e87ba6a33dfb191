"""Ring all-gather: ``n - 1`` segmented steps, each forwarding the block just received."""
from __future__ import annotations

from typing import Any

from .. import buffers
from ..context import CommContext
from .plans import ring_plan
from .registry import register
from .ring_schedule import ring_allgather


@register("allgather", "ring")
def ring_allgather_blocks(ctx: CommContext, send: Any, recv: Any) -> None:
    """Gather every rank's block into ``recv`` (``send=None``: already in place)."""
    block = recv.size // ctx.size
    bounds = ctx.plan(("even_blocks", recv.size), lambda: [i * block for i in range(ctx.size + 1)])
    if send is not None:
        buffers.copy(recv[bounds[ctx.rank]:bounds[ctx.rank + 1]], send)
    plan = ring_plan(ctx, bounds, recv.dtype, recv, with_scratch=False)
    ring_allgather(ctx.p2p, ctx.rank, ctx.size, recv, plan.segb)
