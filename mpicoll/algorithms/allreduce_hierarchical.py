"""Hierarchical (node-aware) all-reduce.

When every node holds the same number of ranks ``L``: ring reduce-scatter inside each node
(local rank ``i`` ends with shard ``i``), all-reduce of shard ``i`` across nodes among the
ranks with local rank ``i`` (every shard in parallel, so every inter-node link is used),
ring all-gather inside each node. Inter-node traffic per rank is ``1 / L`` of the vector.

When nodes hold different numbers of ranks the shards would not line up, so it falls back
to: binomial reduce to each node's leader, all-reduce among the leaders, binomial broadcast
inside each node. Both branches depend only on the layout, which every rank shares.
"""
from __future__ import annotations

from typing import Any

from .. import buffers
from ..context import CommContext, get_context
from .binomial import tree_bcast, tree_reduce
from .plans import rank_blocks, ring_plan, tree_scratch, tree_segments
from .registry import lookup, register
from .ring import ring_allgather, ring_reduce_scatter

__all__ = ["hierarchical_allreduce", "inner_algorithm"]


def inner_algorithm(nbytes: int, size: int) -> str:
    """The all-reduce used among nodes for a shard of ``nbytes`` over ``size`` ranks."""
    from ..selection import choose  # noqa: PLC0415  (import cycle)

    name = choose("allreduce", size, 1, nbytes)
    return "rabenseifner" if name == "hierarchical" else name


def _allreduce_across(comm: Any, part: Any, op: Any) -> None:
    if comm.Get_size() == 1 or part.size == 0:
        return
    cctx = get_context(comm)
    lookup("allreduce", inner_algorithm(part.nbytes, cctx.size))(cctx, part, part, op)


@register("allreduce", "hierarchical")
def hierarchical_allreduce(ctx: CommContext, send: Any, recv: Any, op: Any) -> None:
    """All-reduce ``send`` into ``recv`` in three node-aware phases."""
    topo = ctx.topology
    local = get_context(topo.node_comm)
    if topo.uniform:
        if local.size == 1:
            buffers.copy(recv, send)
            _allreduce_across(topo.cross_comm, recv, op)
            return
        bounds = rank_blocks(local, recv.size)
        plan = ring_plan(local, bounds, recv.dtype, recv)
        ring_reduce_scatter(local.p2p, local.rank, local.size, send, recv, plan.segb,
                            plan.scratch, op, shift=-1)
        mine = recv[bounds[local.rank]:bounds[local.rank + 1]]
        _allreduce_across(topo.cross_comm, mine, op)
        ring_allgather(local.p2p, local.rank, local.size, recv, plan.segb)
        return
    segb = tree_segments(local, recv.size, recv.dtype.itemsize)
    if local.size > 1:
        slots = tree_scratch(local, 0, segb, recv.dtype, recv)
        tree_reduce(local.p2p, local.rank, local.size, 0, send, recv, segb, slots, op)
    else:
        buffers.copy(recv, send)
    if topo.local_rank == 0:
        _allreduce_across(topo.cross_comm, recv, op)
    if local.size > 1:
        tree_bcast(local.p2p, local.rank, local.size, 0, recv, segb)
