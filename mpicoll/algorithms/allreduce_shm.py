"""Shared-memory all-reduce: the ranks of a node reduce through the node's shared window.

Every rank of a node owns a slot of ``MPICOLL_SHM_CHUNK_BYTES`` in the node's window
(:mod:`mpicoll.node_window`; twice: chunk ``k`` uses half ``k % 2``), and maps every
peer's slot. A message goes through in chunks of at most one
slot; for each chunk, with ``n`` ranks on the node and the chunk cut into ``n`` slices:

1. every rank copies its input into its own slot, except its own slice (it reads that one
   from its own buffer), and the node synchronises (the window's barrier);
2. rank ``r`` reduces slice ``r`` over all ranks' inputs in rank order (its own input from
   its buffer, the others from their slots) into slice ``r`` of its own slot (the place no
   peer reads from), and the node synchronises;
3. every rank copies every reduced slice out of the slots into its output.

Each final value is computed once, in a fixed order, and copied: every rank gets the same
bits. The halves alternate across chunks *and calls* (the window remembers which is next),
so the copy-in of one chunk never overwrites what a slower peer is still copying out of the
previous one, with two synchronisations per chunk and none between calls. The first
chunk's first synchronisation also compares every rank's count and dtype (through the
window's mailboxes): ranks that disagree raise ``MismatchError`` alike instead of
reading past each other's slots.

Across several nodes, step 2 is followed by an all-reduce of slice ``r`` among the ranks
with the same local rank on every node (``inner``, chosen when the call is planned, as for
``hierarchical``) before the node synchronises: when nodes hold the same number of ranks.
Otherwise the node-reduced vector is all-reduced among node leaders and broadcast inside
each node through the window. Host (numpy) buffers only.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import buffers
from ..context import CommContext, get_context
from ..errors import MismatchError
from ..node_window import NodeWindow, node_window
from ..partition import block_bounds
from .registry import lookup, register

__all__ = ["shm_allreduce"]


def _slot_view(win: NodeWindow, rank: int, half: int, dtype: np.dtype, count: int) -> Any:
    return win.slots[rank][half][:count * dtype.itemsize].view(dtype)


def _chunk(win: NodeWindow, send: Any, recv: Any, op: Any, cross: Any, inner: str | None,
           scale: int, call: int | None = None) -> None:
    """One chunk through the window (steps 1-3 of the module docstring). ``call``: the
    whole call's key (count, dtype), on its first chunk, compared across the node."""
    n, me = win.size, win.rank
    dtype, count = recv.dtype, recv.size
    half = win.next_half()
    bounds = block_bounds(count, n)
    lo, hi = bounds[me], bounds[me + 1]
    mine = _slot_view(win, me, half, dtype, count)
    if lo:
        buffers.copy(mine[:lo], send[:lo])
    if hi < count:
        buffers.copy(mine[hi:], send[hi:])
    if call is None:
        win.barrier()
    else:
        _agree(win, call)
    if hi > lo:
        out = mine[lo:hi]
        peers = [send[lo:hi] if r == me else _slot_view(win, r, half, dtype, count)[lo:hi]
                 for r in range(n)]
        if n == 1:
            buffers.copy(out, peers[0])
        else:
            op.combine(peers[0], peers[1], out)
            for part in peers[2:]:
                op.combine(out, part, out)
        if cross is not None:
            lookup("allreduce", inner)(cross, out, out, op)
        if scale:
            op.finalize(out, scale)
    win.barrier()
    for r in range(n):
        if bounds[r + 1] > bounds[r]:
            buffers.copy(recv[bounds[r]:bounds[r + 1]],
                         _slot_view(win, r, half, dtype, count)[bounds[r]:bounds[r + 1]])


def _call_key(count: int, dtype: np.dtype) -> int:
    """A call's count and dtype (kind, item size) as one integer."""
    return count << 16 | ord(dtype.kind) << 8 | dtype.itemsize


def _key_text(key: int) -> str:
    kind, size = chr(key >> 8 & 255), key & 255
    try:
        name = np.dtype(f"{kind}{size}").name
    except TypeError:
        name = f"{kind}{size}"
    return f"{key >> 16} x {name}"


def _agree(win: NodeWindow, key: int) -> None:
    """The chunk's first barrier, as the window's exchange of every rank's call ``key``:
    ranks of the node whose counts or dtypes differ all raise, where they would read past
    each other's slots.

    Raises:
        MismatchError: on every rank of the node alike.
    """
    keys = [k for (k,) in win.exchange([key])]
    if keys.count(key) != win.size:
        details = [f"rank {r} of the node: {_key_text(k)}" for r, k in enumerate(keys)]
        raise MismatchError("allreduce (shm): the node's ranks passed different counts or "
                            "dtypes: " + "; ".join(details), details)


def _node_broadcast(win: NodeWindow, buf: Any) -> None:
    """Copy ``buf`` of local rank 0 to every rank of the node, through the window."""
    step = win.slot_bytes // buf.dtype.itemsize
    for start in range(0, buf.size, step):
        part = buf[start:start + step]
        half = win.next_half()
        slot0 = _slot_view(win, 0, half, buf.dtype, part.size)
        if win.rank == 0:
            buffers.copy(slot0, part)
        win.barrier()
        if win.rank:
            buffers.copy(part, slot0)
        win.barrier()


def _chunks(win: NodeWindow, send: Any, recv: Any, op: Any, cross: Any,
            inner: str | None, scale: int = 0) -> None:
    """The message in chunks of one slot; ``scale``: ranks to ``op.finalize`` over (0: no)."""
    step = win.slot_bytes // recv.dtype.itemsize
    call = _call_key(recv.size, recv.dtype)
    for start in range(0, recv.size, step):
        stop = min(start + step, recv.size)
        _chunk(win, send[start:stop], recv[start:stop], op, cross, inner, scale,
               call if start == 0 else None)


@register("allreduce", "shm", scales_shards=True)
def shm_allreduce(ctx: CommContext, send: Any, recv: Any, op: Any, *,
                  inner: str | None = None, finalize: bool = False) -> None:
    """All-reduce ``send`` into ``recv`` through shared memory (``send is recv``: in place).

    ``inner`` names the all-reduce among nodes when there are several (chosen by
    :func:`mpicoll.selection.algorithm_options`); unused on one node. ``finalize``: apply
    ``op.finalize`` (over all ranks) to each reduced slice before it is copied out.

    Raises:
        TypeError: device (non-numpy) buffers.
    """
    if not isinstance(recv, np.ndarray) or not isinstance(send, np.ndarray):
        raise TypeError("algorithm='shm' works on host (numpy) buffers only")
    topo = ctx.topology
    win = node_window(ctx)
    scale = ctx.size if finalize else 0
    if topo.num_nodes == 1:
        _chunks(win, send, recv, op, None, None, scale)
        return
    cross = topo.cross_comm         # where used: one rank of each node, two or more
    if topo.uniform:
        _chunks(win, send, recv, op, get_context(cross), inner, scale)
        return
    _chunks(win, send, recv, op, None, None)
    if topo.local_rank == 0:
        lookup("allreduce", inner)(get_context(cross), recv, recv, op)
        if scale:
            op.finalize(recv, scale)
    _node_broadcast(win, recv)
