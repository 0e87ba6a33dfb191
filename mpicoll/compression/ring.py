"""The flat compressed schedules: a ring for dense codecs, an all-gather for sparse ones.

Both run on any communicator context (all of ``COMM_WORLD``, or the ranks that hold the
same shard on every node in the node-aware layout, :mod:`.node`) over a vector ``y`` (the
compensated input), writing the result to ``out`` and, when ``res`` is given, the
residual of this rank's encodings to ``res``. ``y`` may be ``res`` (the residual's storage
holding ``x + e``) or ``out``; elements are read before they are overwritten.

Dense codecs (``none``, ``fp16``, ``bf16``, ``int8``, ``onebit``):

1. **Reduce-scatter.** The vector is cut into ``n`` blocks (``partition.block_bounds``), each
   into the same number of segments of at most ``segment_bytes`` (of the uncompressed
   input). Rank ``r`` encodes its block ``r`` and sends it right; at step ``s`` it receives
   block ``(r - s - 1) % n`` from the left (the receive two units ahead is already posted),
   decodes it, adds its own values and, while ``s < n - 2``, re-encodes the partial sum and
   forwards it. At ``s = n - 2`` the sum of block ``(r + 1) % n`` is complete; its owner
   encodes it once more: that payload is the block's final value.
2. **All-gather** of the final payloads, as bytes, around the same ring; every rank decodes
   every block from the same bytes (the owner decodes its own payload too), so the result
   is bit-identical on every rank.

Each rank encodes every block exactly once (its own block first, the blocks it forwards,
its final block), so its error feedback residual is one full vector: for each block, what
its one encoding dropped. Summed over ranks, the residuals plus the result equal the sum of
the compensated inputs (up to float rounding of the additions).

Sparse codecs (``topk``, ``randomk``) send ``k = ceil(ratio * count)`` (index, value) pairs
per rank (the same ``k`` on every rank, so no counts are exchanged): a ring all-gather of the
payloads, then every rank adds them into zeros in rank order (identical on every rank).

Messages use tags 101-103 on the context's private duplicate (``CommContext.p2p``).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from .. import buffers
from ..partition import block_bounds, segment_bounds
from .codecs import Codec, layout_nbytes, payload_views

__all__ = ["Sent", "dense_ring", "sparse_allgather", "TAG_RS", "TAG_AG", "TAG_SPARSE"]

TAG_RS = 101      #: ring reduce-scatter of encoded segments
TAG_AG = 102      #: ring all-gather of final encoded segments
TAG_SPARSE = 103  #: all-gather of sparse (index, value) payloads


class Sent(NamedTuple):
    """What one schedule sent from this rank.

    Attributes:
        bytes: payload bytes.
        messages: messages.
        dense: bytes the same schedule sends uncompressed.
    """

    bytes: int = 0
    messages: int = 0
    dense: int = 0

    def __add__(self, other: "Sent") -> "Sent":  # type: ignore[override]
        return Sent(self.bytes + other.bytes, self.messages + other.messages,
                    self.dense + other.dense)


# ---------------------------------------------------------------------------------------
# dense codecs: ring reduce-scatter with re-encoding + all-gather of encoded shards

class _RingPlan:
    """Bounds, payload layouts and buffers of one (codec, count, dtype, segment, n)."""

    def __init__(self, codec: Codec, count: int, dtype: np.dtype, seg_bytes: int,
                 n: int, rank: int) -> None:
        self.n, self.rank = n, rank
        bb = block_bounds(count, n)
        largest = max(bb[i + 1] - bb[i] for i in range(n))
        per = max(1, seg_bytes // dtype.itemsize)
        self.nseg = nseg = max(1, -(-largest // per))
        self.segb = [segment_bounds(bb[b], bb[b + 1], nseg) for b in range(n)]
        # layout and wire bytes of every (block, segment)
        self.layout = [[codec.layout(self.segb[b][j + 1] - self.segb[b][j], dtype)
                        for j in range(nseg)] for b in range(n)]
        self.nbytes = [[layout_nbytes(lay) for lay in row] for row in self.layout]
        # gather area: every block's final payloads back to back, block by block
        self.goff = []
        off = 0
        for b in range(n):
            row = []
            for j in range(nseg):
                row.append(off)
                off += self.nbytes[b][j]
            self.goff.append(row)
        self.gather = np.empty(off, dtype=np.uint8)
        maxseg = max(self.segb[b][j + 1] - self.segb[b][j] for b in range(n)
                     for j in range(nseg))
        maxwire = max(max(row) for row in self.nbytes)
        self.recv = [np.empty(maxwire, dtype=np.uint8) for _ in range(2)]
        # send area: the blocks this rank sends in the reduce-scatter (steps 0..n-2)
        sent = [rank] + [(rank - s - 1) % n for s in range(n - 2)] if n > 1 else []
        self.soff = {}
        off = 0
        for b in sent:
            for j in range(nseg):
                self.soff[(b, j)] = off
                off += self.nbytes[b][j]
        self.send = np.empty(off, dtype=np.uint8)
        self.dec = np.empty(maxseg, dtype=dtype)
        self.rt = np.empty(maxseg, dtype=dtype)

    def views(self, raw: np.ndarray, b: int, j: int) -> tuple:
        return payload_views(self.layout[b][j], raw[:self.nbytes[b][j]])

    def send_region(self, b: int, j: int) -> np.ndarray:
        o = self.soff[(b, j)]
        return self.send[o:o + self.nbytes[b][j]]

    def gather_region(self, b: int, j: int) -> np.ndarray:
        o = self.goff[b][j]
        return self.gather[o:o + self.nbytes[b][j]]


def dense_ring(ctx: Any, codec: Codec, y: np.ndarray, res: np.ndarray | None,
               out: np.ndarray, seg_bytes: int) -> Sent:
    """The compressed ring all-reduce of ``y`` over ``ctx``'s ranks into ``out``.

    Returns:
        What this rank sent.
    """
    n, rank = ctx.size, ctx.rank
    dtype = y.dtype
    key = ("compression.ring", type(codec), codec.name, y.size, dtype.str, seg_bytes)
    plan = ctx.plan(key,
                    lambda: _RingPlan(codec, y.size, dtype, seg_bytes, n, rank))
    p2p = ctx.p2p
    nseg, segb = plan.nseg, plan.segb
    left, right = (rank - 1) % n, (rank + 1) % n
    isend, irecv = p2p.Isend, p2p.Irecv
    sreqs: list[MPI.Request] = []
    sent_bytes = 0

    def finish(acc: np.ndarray, b: int, j: int, lo: int, hi: int) -> None:
        """Encode the complete sum of (b, j) into the gather area; decode it as the result."""
        payload = codec.encode(acc, plan.views(plan.gather_region(b, j), b, j))
        codec.decode(payload, hi - lo, dtype, out=out[lo:hi])
        if res is not None:
            np.subtract(acc, out[lo:hi], out=res[lo:hi])

    if n == 1:
        for j in range(nseg):
            lo, hi = segb[0][j], segb[0][j + 1]
            finish(y[lo:hi], 0, j, lo, hi)
        return Sent()

    # uncompressed ring: every block but (rank+1) in the reduce-scatter, but (rank+2) in
    # the all-gather
    blk = [segb[b][-1] - segb[b][0] for b in range(n)]
    dense = (2 * y.size - blk[(rank + 1) % n] - blk[(rank + 2) % n]) * dtype.itemsize
    units = (n - 1) * nseg

    def unit(u: int) -> tuple[int, int, int, int, int]:
        s, j = divmod(u, nseg)
        b = (rank - s - 1) % n
        return s, b, j, segb[b][j], segb[b][j + 1]

    def post(u: int) -> MPI.Request:
        _, b, j, _, _ = unit(u)
        return irecv([plan.recv[u % 2], plan.nbytes[b][j], MPI.BYTE], left, TAG_RS)

    rreqs = [post(u) for u in range(min(2, units))]
    # step 0: this rank's own block, encoded from its (compensated) input
    for j in range(nseg):
        lo, hi = segb[rank][j], segb[rank][j + 1]
        region = plan.send_region(rank, j)
        payload = codec.encode(y[lo:hi], plan.views(region, rank, j))
        sreqs.append(isend(buffers.msg(region), right, TAG_RS))
        sent_bytes += region.size
        if res is not None:
            rt = codec.decode(payload, hi - lo, dtype, out=plan.rt[:hi - lo])
            np.subtract(y[lo:hi], rt, out=res[lo:hi])
    for u in range(units):
        slot = u % 2
        rreqs[slot].Wait()
        s, b, j, lo, hi = unit(u)
        cnt = hi - lo
        acc = codec.decode(plan.views(plan.recv[slot], b, j), cnt, dtype, out=plan.dec[:cnt])
        if u + 2 < units:
            rreqs[slot] = post(u + 2)
        np.add(acc, y[lo:hi], out=acc)
        if s < n - 2:
            region = plan.send_region(b, j)
            payload = codec.encode(acc, plan.views(region, b, j))
            sreqs.append(isend(buffers.msg(region), right, TAG_RS))
            sent_bytes += region.size
            if res is not None:
                rt = codec.decode(payload, cnt, dtype, out=plan.rt[:cnt])
                np.subtract(acc, rt, out=res[lo:hi])
        else:
            finish(acc, b, j, lo, hi)

    # all-gather of the final payloads; rank owns block (rank + 1) % n
    order = [((rank - s) % n, j) for s in range(n - 1) for j in range(nseg)]
    agreqs = [irecv(buffers.msg(plan.gather_region(b, j)), left, TAG_AG) for b, j in order]
    own = (rank + 1) % n
    for j in range(nseg):
        region = plan.gather_region(own, j)
        sreqs.append(isend(buffers.msg(region), right, TAG_AG))
        sent_bytes += region.size

    forward = (n - 2) * nseg
    for i, (b, j) in enumerate(order):
        agreqs[i].Wait()
        region = plan.gather_region(b, j)
        if i < forward:
            sreqs.append(isend(buffers.msg(region), right, TAG_AG))
            sent_bytes += region.size
        lo, hi = segb[b][j], segb[b][j + 1]
        codec.decode(plan.views(region, b, j), hi - lo, dtype, out=out[lo:hi])
    MPI.Request.Waitall(sreqs)
    return Sent(sent_bytes, len(sreqs), dense)


# ---------------------------------------------------------------------------------------
# sparse codecs: all-gather of (index, value) payloads, summed in rank order

def sparse_allgather(ctx: Any, codec: Codec, y: np.ndarray, res: np.ndarray | None,
                     out: np.ndarray) -> Sent:
    """The sparse all-reduce of ``y`` over ``ctx``'s ranks into ``out``.

    Returns:
        What this rank sent (``dense``: an uncompressed ring all-reduce of ``y``).
    """
    n, rank = ctx.size, ctx.rank
    dtype = y.dtype
    layout = codec.layout(y.size, dtype)
    nbytes = layout_nbytes(layout)
    area = np.empty(n * nbytes, dtype=np.uint8)
    region = [area[q * nbytes:(q + 1) * nbytes] for q in range(n)]
    payload = codec.encode(y, payload_views(layout, region[rank]))
    sreqs: list[MPI.Request] = []
    sent_bytes = 0
    if n > 1:
        left, right = (rank - 1) % n, (rank + 1) % n
        order = [(rank - s - 1) % n for s in range(n - 1)]
        rreqs = [ctx.p2p.Irecv(buffers.msg(region[q]), left, TAG_SPARSE) for q in order]
        sreqs.append(ctx.p2p.Isend(buffers.msg(region[rank]), right, TAG_SPARSE))
        sent_bytes += nbytes
    if res is not None:
        sent = codec.decode(payload, y.size, dtype, out=out)
        np.subtract(y, sent, out=res)
    if n > 1:
        for i, q in enumerate(order):
            rreqs[i].Wait()
            if i < n - 2:
                sreqs.append(ctx.p2p.Isend(buffers.msg(region[q]), right, TAG_SPARSE))
                sent_bytes += nbytes
    out.fill(0)
    for q in range(n):
        idx, vals = codec.indices_values(payload_views(layout, region[q]))
        out[idx] += vals  # indices of one payload are distinct
    MPI.Request.Waitall(sreqs)
    return Sent(sent_bytes, len(sreqs), 2 * (n - 1) * y.size * dtype.itemsize // n)
