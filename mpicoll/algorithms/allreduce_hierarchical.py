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
from ..partition import block_bounds
from .binomial_schedule import tree_bcast, tree_reduce
from .plans import rank_blocks, ring_plan, tree_scratch, tree_segments
from .registry import lookup, register
from .ring_schedule import ring_allgather, ring_reduce_scatter

__all__ = ["hierarchical_allreduce", "cross_node_message"]


def cross_node_message(ctx: CommContext, count: int, itemsize: int) -> tuple[int, int]:
    """``(bytes, ranks)`` of the all-reduce this rank joins among nodes.

    Computed from the layout alone, the same on every rank of that all-reduce, so the
    inner algorithm is chosen when a call is planned
    (:func:`mpicoll.selection.inner_allreduce`). No communication: planning happens before
    the agreement step, which a rank with bad arguments may already be waiting in.
    ``ranks`` is 1 when the rank joins none.
    """
    topo = ctx.topology
    ranks = topo.cross_comm.Get_size()
    if not topo.uniform:
        return (count * itemsize, ranks) if topo.local_rank == 0 else (0, 1)
    bounds = block_bounds(count, topo.local_size)  # the blocks of the node's ring
    return (bounds[topo.local_rank + 1] - bounds[topo.local_rank]) * itemsize, ranks


def _allreduce_across(comm: Any, part: Any, op: Any, inner: str) -> None:
    if comm.Get_size() == 1 or part.size == 0:
        return
    lookup("allreduce", inner)(get_context(comm), part, part, op)


@register("allreduce", "hierarchical", scales_shards=True)
def hierarchical_allreduce(ctx: CommContext, send: Any, recv: Any, op: Any, *,
                           inner: str, finalize: bool = False) -> None:
    """All-reduce ``send`` into ``recv`` in three node-aware phases.

    ``inner`` names the registered all-reduce run among nodes (chosen by the caller,
    normally :func:`mpicoll.selection.inner_allreduce`, for the message of
    :func:`cross_node_message`). ``finalize``: apply ``op.finalize`` (over all ranks) to
    this rank's shard once it is reduced across nodes, before it is copied around the node.
    """
    topo = ctx.topology
    local = get_context(topo.node_comm)
    if topo.uniform and local.size > 1:
        bounds = rank_blocks(local, recv.size)
        plan = ring_plan(local, bounds, recv.dtype, recv)
        ring_reduce_scatter(local.p2p, local.rank, local.size, send, recv, plan.segb,
                            plan.scratch, op, shift=-1)
        mine = recv[bounds[local.rank]:bounds[local.rank + 1]]
        _allreduce_across(topo.cross_comm, mine, op, inner)
        if finalize:
            op.finalize(mine, ctx.size)
        ring_allgather(local.p2p, local.rank, local.size, recv, plan.segb)
        return
    if local.size > 1:   # else one rank a node: it is its node's leader
        segb = tree_segments(local, recv.size, recv.dtype.itemsize)
        slots = tree_scratch(local, 0, segb, recv.dtype, recv)
        tree_reduce(local.p2p, local.rank, local.size, 0, send, recv, segb, slots, op)
    else:
        buffers.copy(recv, send)
    if topo.local_rank == 0:
        _allreduce_across(topo.cross_comm, recv, op, inner)
        if finalize:
            op.finalize(recv, ctx.size)
    if local.size > 1:
        tree_bcast(local.p2p, local.rank, local.size, 0, recv, segb)
