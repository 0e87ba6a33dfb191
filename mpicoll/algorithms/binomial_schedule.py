"""Binomial-tree schedules (reduce, broadcast, scatter), segmented and pipelined.

Ranks are renumbered relative to the root (``v = (rank - root) % n``). A node's children
are ``v + 1, v + 2, v + 4, ...`` below its lowest set bit. Buffers are cut into segments
(``segb``: segment offsets); each segment flows through the tree as its own message, so a
parent combines segment ``j`` while segment ``j + 1`` is arriving.
"""
from __future__ import annotations

from typing import Any, Sequence

from mpi4py import MPI

from .. import waiting
from ..buffers import msg
from ..partition import subtree_size, tree_children, tree_parent

__all__ = ["tree_reduce", "tree_bcast", "tree_scatter"]

TAG_REDUCE = 31
TAG_BCAST = 32
TAG_SCATTER = 33


def tree_reduce(p2p: MPI.Comm, rank: int, size: int, root: int, src: Any, acc: Any,
                segb: Sequence[int], scratch: Sequence[Sequence[Any]], op: Any) -> Any:
    """Reduce every rank's ``src`` to ``root`` over a binomial tree.

    Args:
        src: this rank's contribution.
        acc: where this rank accumulates its subtree (unused on leaves); on the root it
            receives the result.
        segb: segment offsets ``[0, ..., count]``.
        scratch: ``scratch[slot][child_index]``: two slots of one segment-sized buffer per
            child.
        op: object with ``combine(a, b, out)``; combines keep relative-rank order.
    Returns:
        The array holding this rank's subtree result (``acc``, or ``src`` on a leaf).
    """
    v = (rank - root) % size
    children = [(c + root) % size for c in tree_children(v, size)]
    parent = (tree_parent(v) + root) % size if v else None
    nseg = len(segb) - 1

    def post(j: int) -> list[MPI.Request]:
        width = segb[j + 1] - segb[j]
        slot = scratch[j % 2]
        return [p2p.Irecv(msg(slot[i][:width]), c, TAG_REDUCE) for i, c in enumerate(children)]

    sreqs = []
    pending = post(0) if children else []
    for j in range(nseg):
        lo, hi = segb[j], segb[j + 1]
        current = pending
        if children and j + 1 < nseg:
            pending = post(j + 1)
        part = src[lo:hi]
        for i, req in enumerate(current):
            waiting.wait(req)
            out = acc[lo:hi]
            op.combine(part, scratch[j % 2][i][:hi - lo], out)
            part = out
        if parent is not None:
            sreqs.append(p2p.Isend(msg(part), parent, TAG_REDUCE))
    waiting.waitall(sreqs)
    return acc if children else src


def tree_bcast(p2p: MPI.Comm, rank: int, size: int, root: int, buf: Any,
               segb: Sequence[int]) -> None:
    """Broadcast ``buf`` from ``root`` over a binomial tree, segment by segment."""
    v = (rank - root) % size
    children = [(c + root) % size for c in reversed(tree_children(v, size))]
    nseg = len(segb) - 1
    segments = [buf[segb[j]:segb[j + 1]] for j in range(nseg)]
    rreqs = []
    if v:
        parent = (tree_parent(v) + root) % size
        rreqs = [p2p.Irecv(msg(s), parent, TAG_BCAST) for s in segments]
    sreqs = []
    for j, seg in enumerate(segments):
        if rreqs:
            waiting.wait(rreqs[j])
        sreqs.extend(p2p.Isend(msg(seg), c, TAG_BCAST) for c in children)
    waiting.waitall(sreqs)


def tree_scatter(p2p: MPI.Comm, rank: int, size: int, root: int, buf: Any,
                 bounds: Sequence[int]) -> None:
    """Binomial scatter in place: relative rank ``v`` ends holding block ``v`` of ``buf``.

    ``bounds`` are the ``size + 1`` block offsets, indexed by relative rank; each node
    receives its whole subtree's blocks (contiguous) and passes the children theirs.
    """
    v = (rank - root) % size
    if v:
        parent = (tree_parent(v) + root) % size
        top = v + subtree_size(v, size)
        waiting.recv(p2p, msg(buf[bounds[v]:bounds[top]]), parent, TAG_SCATTER)
    sreqs = []
    for c in reversed(tree_children(v, size)):
        top = c + subtree_size(c, size)
        sreqs.append(p2p.Isend(msg(buf[bounds[c]:bounds[top]]), (c + root) % size,
                               TAG_SCATTER))
    waiting.waitall(sreqs)
