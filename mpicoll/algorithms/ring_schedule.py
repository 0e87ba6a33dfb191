"""Segmented, pipelined ring schedules shared by the ring algorithms.

Both kernels move one block per step around the ring ``rank -> rank + 1``; each block is cut
into ``nseg`` segments and every segment travels as its own message, so a rank forwards
segment ``j`` as soon as it has it (and, in the reduce-scatter, reduces segment ``j`` while
segment ``j + 1`` is arriving into the second scratch buffer).

``shift`` rotates which block a rank starts with: in the all-gather rank ``r`` starts
owning block ``(r + shift) % n``; in the reduce-scatter it ends owning block
``(r + shift + 1) % n``.
"""
from __future__ import annotations

from typing import Any, Sequence

from mpi4py import MPI

from .. import waiting
from ..buffers import msg

__all__ = ["ring_reduce_scatter", "ring_allgather", "TAG_RS", "TAG_AG"]

TAG_RS = 11
TAG_AG = 12


def ring_reduce_scatter(p2p: MPI.Comm, rank: int, size: int, src: Any, dst: Any,
                        segb: Sequence[Sequence[int]], scratch: Sequence[Any], op: Any,
                        shift: int = 0, final: Any = None, final_offset: int = 0) -> None:
    """Ring reduce-scatter: rank ends with block ``(rank + shift + 1) % size`` reduced.

    Args:
        p2p: communicator for the messages.
        src: this rank's contribution (full vector); may be ``dst``.
        dst: full-length array receiving the partial reductions.
        segb: ``segb[b]`` is the list of ``nseg + 1`` segment offsets of block ``b``.
        scratch: receive buffers (two or more, each as large as the largest segment).
        op: object with ``combine(a, b, out)``.
        shift: rotation of the schedule (see module docstring).
        final: if given, the owned block's reduction is written here instead of ``dst``;
            ``final[k]`` stands for element ``final_offset + k``.
    """
    n = size
    nseg = len(segb[0]) - 1
    left, right = (rank - 1) % n, (rank + 1) % n
    units = (n - 1) * nseg
    depth = len(scratch)
    irecv, isend = p2p.Irecv, p2p.Isend

    def seg_of(u: int) -> tuple[int, int, int]:
        s, j = divmod(u, nseg)
        bounds = segb[(rank - s - 1 + shift) % n]
        return s, bounds[j], bounds[j + 1]

    def post(u: int) -> MPI.Request:
        _, lo, hi = seg_of(u)
        return irecv(msg(scratch[u % depth][:hi - lo]), left, TAG_RS)

    own = segb[(rank + shift) % n]
    sreqs = [isend(msg(src[own[j]:own[j + 1]]), right, TAG_RS) for j in range(nseg)]
    rreqs = [post(u) for u in range(min(depth, units))]
    for u in range(units):
        slot = u % depth
        waiting.wait(rreqs[slot])
        s, lo, hi = seg_of(u)
        if final is not None and s == n - 2:
            out = final[lo - final_offset:hi - final_offset]
        else:
            out = dst[lo:hi]
        op.combine(scratch[slot][:hi - lo], src[lo:hi], out)
        if u + depth < units:
            rreqs[slot] = post(u + depth)
        if s < n - 2:
            sreqs.append(isend(msg(out), right, TAG_RS))
    waiting.waitall(sreqs)


def ring_allgather(p2p: MPI.Comm, rank: int, size: int, buf: Any,
                   segb: Sequence[Sequence[int]], shift: int = 0) -> None:
    """Ring all-gather in place: rank starts owning block ``(rank + shift) % size`` of ``buf``.

    Every receive lands directly in ``buf`` (no scratch); all are posted up front.
    """
    n = size
    nseg = len(segb[0]) - 1
    left, right = (rank - 1) % n, (rank + 1) % n
    irecv, isend = p2p.Irecv, p2p.Isend
    regions = []
    for s in range(n - 1):
        bounds = segb[(rank - s - 1 + shift) % n]
        regions.extend(buf[bounds[j]:bounds[j + 1]] for j in range(nseg))
    rreqs = [irecv(msg(r), left, TAG_AG) for r in regions]
    own = segb[(rank + shift) % n]
    sreqs = [isend(msg(buf[own[j]:own[j + 1]]), right, TAG_AG) for j in range(nseg)]
    forward = (n - 2) * nseg
    for u in range(len(regions)):
        waiting.wait(rreqs[u])
        if u < forward:
            sreqs.append(isend(msg(regions[u]), right, TAG_AG))
    waiting.waitall(sreqs)
