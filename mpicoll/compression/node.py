"""The node-aware layout of the compressed all-reduce: compress only what crosses nodes.

With several nodes and several ranks on some node (real nodes, or emulated with
``MPICOLL_RANKS_PER_NODE``: :mod:`mpicoll.topology`), the all-reduce runs in three phases,
the shape of ``hierarchical`` (:mod:`mpicoll.algorithms.allreduce_hierarchical`):

**Every node holds ``L`` ranks.**

1. Uncompressed ring reduce-scatter of the compensated inputs inside each node: local rank
   ``i`` ends with the node's exact sum of shard ``i`` (``numpy.array_split`` of the vector
   into ``L`` shards).
2. The flat compressed all-reduce (:mod:`.ring`: the re-encoding ring for dense codecs, the
   (index, value) all-gather for sparse ones) of shard ``i`` among the ranks with local rank
   ``i`` on every node (``Topology.cross_comm``), all shards at once. Every message of this
   phase crosses nodes, and only this phase encodes.
3. Uncompressed ring all-gather of the decoded shards inside each node.

**Nodes of different sizes** (shards would not line up): binomial reduce of the
compensated inputs to each node's first rank, the compressed all-reduce of the whole
vector among those leaders, binomial broadcast inside each node. Ranks that are not
leaders encode nothing; for sparse codecs they encode an empty vector, so that a stateful
codec (random-k's step) advances alike on every rank.

A rank's residual is what its own encodings dropped: its shard's part of phase 2 (the
whole vector on a leader), zero elsewhere. Its compensated input ``x + e`` enters the node
sum whole, so the identity of the flat ring holds: summed over ranks, the residuals plus
the result equal the sum of the compensated inputs (up to float rounding). The decoded
shards are copied, never re-reduced, so every rank gets the same bits.

Messages: tags of :mod:`mpicoll.algorithms.ring_schedule` and
:mod:`mpicoll.algorithms.binomial_schedule` on the node communicator's context, and
:mod:`.ring`'s on the cross communicator's.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from ..algorithms.binomial_schedule import tree_bcast, tree_reduce
from ..algorithms.plans import rank_blocks, ring_plan, tree_scratch, tree_segments
from ..algorithms.ring_schedule import ring_allgather, ring_reduce_scatter
from ..context import CommContext, get_context
from ..ops import SUM
from ..partition import tree_children
from .codecs import Codec
from .ring import Sent, flat_allreduce

__all__ = ["LAYOUTS", "resolve_layout", "node_allreduce", "flat_split", "node_peers"]

#: Values of ``layout=``.
LAYOUTS = ("auto", "flat", "node")


def check_layout(layout: Any) -> str:
    """Return ``layout`` if it is one of :data:`LAYOUTS`.

    Raises:
        TypeError: not a string.
        ValueError: another string.
    """
    if not isinstance(layout, str):
        raise TypeError(f"layout must be 'auto', 'flat' or 'node', not {type(layout).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout={layout!r}; choose 'auto', 'flat' or 'node'")
    return layout


def resolve_layout(ctx: CommContext, layout: str, device: bool = False) -> str:
    """``"flat"`` or ``"node"``: ``auto`` is ``node`` when the communicator spans several
    nodes and some node holds more than one rank (for device arrays always ``flat``). From
    the layout alone, the same on every rank (no communication; the topology was computed
    when the context was).

    Raises:
        ValueError: ``layout="node"`` for device arrays (its intra-node phases run on the
            host only).
    """
    if layout == "node" and device:
        raise ValueError("layout='node' takes host arrays only (its uncompressed phases "
                         "inside the node do not run on device arrays); use layout='flat' "
                         "or 'auto' (flat for device arrays)")
    if layout != "auto":
        return layout
    if device or ctx.size == 1:
        return "flat"
    topo = ctx.topology
    return "node" if topo.num_nodes > 1 and max(topo.node_sizes) > 1 else "flat"


def node_peers(ctx: CommContext) -> frozenset[int]:
    """The ranks of ``ctx`` on this rank's node (itself included); cached per context."""
    if ctx.size == 1:
        return frozenset([0])

    def peers() -> frozenset[int]:
        node = ctx.topology.node_comm
        mine, every = node.Get_group(), ctx.comm.Get_group()
        ranks = MPI.Group.Translate_ranks(mine, list(range(node.Get_size())), every)
        mine.Free()
        every.Free()
        return frozenset(ranks)

    return ctx.plan(("compression.node_peers",), peers)


def flat_split(ctx: CommContext, sent: Sent) -> tuple[Sent, Sent]:
    """``(intra-node, inter-node)`` of what a flat ring schedule sent (all to the right
    neighbour, ``rank + 1``: on this node or not; the flat schedules send only to it)."""
    crosses = (ctx.rank + 1) % ctx.size not in node_peers(ctx)
    return (Sent(), sent) if crosses else (sent, Sent())


def node_allreduce(ctx: CommContext, codec: Codec, y: np.ndarray, res: np.ndarray | None,
                   out: np.ndarray, seg_bytes: int) -> tuple[Sent, Sent]:
    """The node-aware compressed all-reduce of ``y`` (the compensated input; it may be
    ``res``'s storage) into ``out``; ``res``: this rank's new residual, or ``None``.

    Returns:
        ``(intra-node, inter-node)``: what this rank sent inside its node and to other
        nodes.
    """
    topo = ctx.topology
    local = get_context(topo.node_comm)
    if local.size == 1:     # alone on its node (uniform or not): the cross-node phase only
        return Sent(), flat_allreduce(get_context(topo.cross_comm), codec, y, res, out,
                                      seg_bytes)
    # the node sum goes where the compensated input is no longer needed
    target = res if res is not None else out
    itemsize = y.dtype.itemsize
    if topo.uniform:
        bounds = rank_blocks(local, y.size)
        plan = ring_plan(local, bounds, y.dtype, target)
        ring_reduce_scatter(local.p2p, local.rank, local.size, y, target, plan.segb,
                            plan.scratch, SUM, shift=-1)
        lo, hi = bounds[local.rank], bounds[local.rank + 1]
        inter = flat_allreduce(get_context(topo.cross_comm), codec, target[lo:hi],
                               None if res is None else res[lo:hi], out[lo:hi], seg_bytes)
        if res is not None:
            res[:lo] = 0
            res[hi:] = 0
        ring_allgather(local.p2p, local.rank, local.size, out, plan.segb)
        blk = [bounds[b + 1] - bounds[b] for b in range(local.size)]
        # reduce-scatter: every block but this rank's; all-gather: every block but the next
        intra = (2 * y.size - blk[local.rank] - blk[(local.rank + 1) % local.size]) * itemsize
        nmsg = 2 * (local.size - 1) * (len(plan.segb[0]) - 1)
        return Sent(intra, nmsg, intra), inter
    segb = tree_segments(local, y.size, itemsize)
    slots = tree_scratch(local, 0, segb, y.dtype, target)
    tree_reduce(local.p2p, local.rank, local.size, 0, y, target, segb, slots, SUM)
    inter = Sent()
    if local.rank == 0:
        inter = flat_allreduce(get_context(topo.cross_comm), codec, target, res, out,
                               seg_bytes)
    else:
        if res is not None:
            res.fill(0)
        if not codec.dense:
            codec.encode(np.empty(0, dtype=y.dtype))  # keep the codec's step in line
    tree_bcast(local.p2p, local.rank, local.size, 0, out, segb)
    sends = (0 if local.rank == 0 else 1) + len(tree_children(local.rank, local.size))
    intra = sends * y.size * itemsize
    return Sent(intra, sends * (len(segb) - 1), intra), inter
