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

The compressed reduce-scatter (:func:`dense_reduce_scatter`) is phase 1 alone, started one
block earlier (rank ``r`` encodes block ``r - 1`` first) so that rank ``r`` completes block
``r``; that complete sum is its result as it is (never encoded), so its residual holds what
its ``n - 1`` encodings of the other blocks dropped and is zero on its own block.

The compressed all-gather (:func:`payload_allgather`, any codec) is phase 2 alone: each rank
encodes its own block once, the payloads go around the ring, every rank decodes every block.

Sparse codecs (``topk``, ``randomk``) send ``k = ceil(ratio * count)`` (index, value) pairs
per rank (the same ``k`` on every rank, so no counts are exchanged): a ring all-gather of the
payloads, then every rank adds them into zeros in rank order (identical on every rank).

Messages use tags 101-104 on the context's private duplicate (``CommContext.p2p``).

Device arrays (CuPy, or what :mod:`.namespace` registers): ``y``, ``res`` and ``out`` stay
on the device, and encoding, decoding and the additions run in their array module; the
payloads are encoded into device scratch and only their bytes are copied into the host
buffers that MPI sends (:func:`encode_to_host`: the copy is ordered after the encoding and
complete before the send), and received payloads are copied to the device by
``Codec.decode``. The dense vector never crosses. A CUDA-aware MPI could send the device
payloads directly; that is not done (the host buffers are used whatever MPI is).
"""
from __future__ import annotations

from itertools import accumulate
from typing import Any, Callable, NamedTuple

import numpy as np
from mpi4py import MPI

from .. import buffers, waiting
from . import namespace
from ..partition import block_bounds, segment_bounds, segment_count
from .codecs import Codec, layout_nbytes, payload_views

__all__ = ["Sent", "encode_to_host", "keep_residual", "add_pairs", "side_key", "flat_allreduce",
           "dense_ring", "dense_reduce_scatter", "payload_allgather",
           "sparse_allgather", "gather_phase", "TAG_RS", "TAG_AG", "TAG_SPARSE", "TAG_GATHER"]

TAG_RS = 101      #: ring reduce-scatter of encoded segments
TAG_AG = 102      #: ring all-gather of final encoded segments
TAG_SPARSE = 103  #: all-gather of sparse (index, value) payloads
TAG_GATHER = 104  #: the compressed all-gather's encoded blocks


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


# ---------------------------------------------------------------------------------------
# dense codecs: ring reduce-scatter with re-encoding + all-gather of encoded shards

class _RingPlan:
    """Bounds, payload layouts and buffers of one (codec, count, dtype, segment, n, first).

    ``first``: the block this rank encodes at step 0 of the reduce-scatter (its own in the
    all-reduce, the one before its own in the reduce-scatter). ``gathers``: whether the
    complete sums are encoded once more and all-gathered (the all-reduce).
    """

    def __init__(self, codec: Codec, count: int, dtype: np.dtype, seg_bytes: int,
                 n: int, rank: int, first: int, gathers: bool, like: Any) -> None:
        self.n, self.rank, self.first = n, rank, first
        self.xp = xp = namespace.array_module(like)
        bb = block_bounds(count, n)
        largest = max(bb[i + 1] - bb[i] for i in range(n))
        self.nseg = nseg = segment_count(largest, dtype.itemsize, seg_bytes)
        self.segb = [segment_bounds(bb[b], bb[b + 1], nseg) for b in range(n)]
        # layout and wire bytes of every (block, segment)
        self.layout = [[codec.layout(self.segb[b][j + 1] - self.segb[b][j], dtype)
                        for j in range(nseg)] for b in range(n)]
        self.nbytes = [[layout_nbytes(lay) for lay in row] for row in self.layout]
        # gather area: every block's final payloads back to back, block by block
        starts = list(accumulate((nb if gathers else 0 for row in self.nbytes for nb in row),
                                 initial=0))
        self.goff = [starts[b * nseg:(b + 1) * nseg] for b in range(n)]
        self.gather = np.empty(starts[-1], dtype=np.uint8)
        maxseg = max(self.segb[b][j + 1] - self.segb[b][j] for b in range(n)
                     for j in range(nseg))
        maxwire = max(max(row) for row in self.nbytes)
        self.recv = [np.empty(maxwire, dtype=np.uint8) for _ in range(2)]
        # send area: the blocks this rank sends in the reduce-scatter (steps 0..n-2)
        sent = [first] + [(first - s - 1) % n for s in range(n - 2)] if n > 1 else []
        units = [(b, j) for b in sent for j in range(nseg)]
        starts = list(accumulate((self.nbytes[b][j] for b, j in units), initial=0))
        self.soff = dict(zip(units, starts))
        self.send = np.empty(starts[-1], dtype=np.uint8)
        # on the vector's side: decoded sums, round trips, and (device) encoded payloads
        self.dec = xp.empty(maxseg, dtype=dtype)
        self.rt = xp.empty(maxseg, dtype=dtype)
        self.scratch = None if namespace.is_host_module(xp) else xp.empty(maxwire, np.uint8)

    def encode(self, codec: Codec, x: Any, region: np.ndarray, b: int, j: int) -> tuple:
        """Encode segment (b, j) ``x`` into host ``region``; the payload on ``x``'s side."""
        return encode_to_host(codec, x, self.layout[b][j], region, self.scratch)

    def views(self, raw: np.ndarray, b: int, j: int) -> tuple:
        return payload_views(self.layout[b][j], raw[:self.nbytes[b][j]])

    def send_region(self, b: int, j: int) -> np.ndarray:
        o = self.soff[(b, j)]
        return self.send[o:o + self.nbytes[b][j]]

    def gather_region(self, b: int, j: int) -> np.ndarray:
        o = self.goff[b][j]
        return self.gather[o:o + self.nbytes[b][j]]


def side_key(x: Any) -> tuple:
    """What a plan's buffers depend on besides sizes: the array module and device of ``x``."""
    return (namespace.array_module(x).__name__, getattr(getattr(x, "device", None), "id", None))


def encode_to_host(codec: Codec, x: Any, layout: tuple, region: np.ndarray,
                   scratch: Any = None) -> tuple:
    """Encode ``x`` into the host byte buffer ``region`` (of ``layout``); return the payload
    on ``x``'s side: ``region``'s views for host ``x``; for a device ``x`` the payload is
    encoded into device ``scratch`` (allocated when ``None``) and only its bytes are copied
    to ``region`` (complete when this returns, so ``region`` may be sent)."""
    if namespace.is_host_module(namespace.array_module(x)):
        return codec.encode(x, payload_views(layout, region))
    raw = scratch[:region.size] if scratch is not None else \
        namespace.array_module(x).empty(region.size, np.uint8)
    payload = codec.encode(x, payload_views(layout, raw))
    codec.to_host_payload(raw, out=region)
    return payload


def _ring_plan(ctx: Any, codec: Codec, y: Any, seg_bytes: int, first: int,
               gathers: bool) -> _RingPlan:
    key = ("compression.ring", type(codec), codec.name, y.size, y.dtype.str, seg_bytes,
           first, gathers, side_key(y))
    return ctx.plan(key, lambda: _RingPlan(codec, y.size, y.dtype, seg_bytes, ctx.size,
                                           ctx.rank, first, gathers, y))


#: ``finish(acc, b, j, lo, hi)``: what a rank does with the complete sum ``acc`` of
#: segment ``j`` of block ``b`` (elements ``lo:hi`` of the vector).
Finish = Callable[[np.ndarray, int, int, int, int], None]


def keep_residual(codec: Codec, payload: tuple, acc: Any, res: Any, lo: int,
                  scratch: Any = None) -> None:
    """``res[lo:lo + acc.size] = acc - decode(payload)``: what encoding ``acc`` dropped
    (nothing when ``res`` is ``None``), decoded into ``scratch`` (or a new array)."""
    if res is not None:
        rt = codec.decode(payload, acc.size, acc.dtype, out=scratch)
        namespace.array_module(acc).subtract(acc, rt, out=res[lo:lo + acc.size])


def _reduce_scatter_phase(ctx: Any, codec: Codec, plan: _RingPlan, y: np.ndarray,
                          res: np.ndarray | None, finish: Finish) -> tuple[list, int]:
    """The ring reduce-scatter with re-encoding (``n > 1``): this rank encodes block
    ``plan.first`` and sends it right; at step ``s`` it receives block ``first - s - 1``,
    decodes it, adds its own values and, while ``s < n - 2``, re-encodes and forwards the
    partial sum; at ``s = n - 2`` block ``first + 1``'s sum is complete: ``finish``.

    Returns:
        ``(send requests still in flight, bytes sent)``.
    """
    n, rank, first = ctx.size, ctx.rank, plan.first
    nseg, segb = plan.nseg, plan.segb
    left, right = (rank - 1) % n, (rank + 1) % n
    isend, irecv = ctx.p2p.Isend, ctx.p2p.Irecv
    sreqs: list[MPI.Request] = []
    units = (n - 1) * nseg

    def unit(u: int) -> tuple[int, int, int, int, int]:
        s, j = divmod(u, nseg)
        b = (first - s - 1) % n
        return s, b, j, segb[b][j], segb[b][j + 1]

    def post(u: int) -> MPI.Request:
        _, b, j, _, _ = unit(u)
        return irecv([plan.recv[u % 2], plan.nbytes[b][j], MPI.BYTE], left, TAG_RS)

    rreqs = [post(u) for u in range(min(2, units))]
    # step 0: the first block, encoded from this rank's (compensated) input
    for j in range(nseg):
        lo, hi = segb[first][j], segb[first][j + 1]
        region = plan.send_region(first, j)
        payload = plan.encode(codec, y[lo:hi], region, first, j)
        sreqs.append(isend(buffers.msg(region), right, TAG_RS))
        keep_residual(codec, payload, y[lo:hi], res, lo, plan.rt[:hi - lo])
    for u in range(units):
        slot = u % 2
        waiting.wait(rreqs[slot])
        s, b, j, lo, hi = unit(u)
        cnt = hi - lo
        acc = codec.decode(plan.views(plan.recv[slot], b, j), cnt, y.dtype,
                           out=plan.dec[:cnt])
        if u + 2 < units:
            rreqs[slot] = post(u + 2)
        plan.xp.add(acc, y[lo:hi], out=acc)
        if s < n - 2:
            region = plan.send_region(b, j)
            payload = plan.encode(codec, acc, region, b, j)
            sreqs.append(isend(buffers.msg(region), right, TAG_RS))
            keep_residual(codec, payload, acc, res, lo, plan.rt[:hi - lo])
        else:
            finish(acc, b, j, lo, hi)
    return sreqs, plan.send.size      # the send area: each unit sent, once


def gather_phase(ctx: Any, region: Callable[[int, int], np.ndarray], own: int, nseg: int,
                 tag: int, mine: Callable[[], None] | None = None,
                 arrived: Callable[[int, int], None] | None = None) -> tuple[list, int]:
    """Ring all-gather of byte regions, forwarded as they are, never re-encoded.

    Every rank's ``region(own, j)`` (``j < nseg``) goes around the ring; the others arrive
    from the left in the order ``own - 1, own - 2, ...``. ``mine()`` runs after this rank's
    own regions are sent, ``arrived(b, j)`` after each region is received and forwarded.

    Returns:
        ``(send requests still in flight, bytes sent)``.
    """
    n, rank = ctx.size, ctx.rank
    sreqs: list[MPI.Request] = []
    sent_bytes = 0
    if n == 1:
        if mine is not None:
            mine()
        return sreqs, sent_bytes
    left, right = (rank - 1) % n, (rank + 1) % n
    isend, irecv = ctx.p2p.Isend, ctx.p2p.Irecv
    order = [((own - s - 1) % n, j) for s in range(n - 1) for j in range(nseg)]
    rreqs = [irecv(buffers.msg(region(b, j)), left, tag) for b, j in order]
    for j in range(nseg):
        r = region(own, j)
        sreqs.append(isend(buffers.msg(r), right, tag))
        sent_bytes += r.size
    if mine is not None:
        mine()
    forward = (n - 2) * nseg
    for i, (b, j) in enumerate(order):
        waiting.wait(rreqs[i])
        if i < forward:
            r = region(b, j)
            sreqs.append(isend(buffers.msg(r), right, tag))
            sent_bytes += r.size
        if arrived is not None:
            arrived(b, j)
    return sreqs, sent_bytes


def dense_ring(ctx: Any, codec: Codec, y: np.ndarray, res: np.ndarray | None,
               out: np.ndarray, seg_bytes: int) -> Sent:
    """The compressed ring all-reduce of ``y`` over ``ctx``'s ranks into ``out``.

    Returns:
        What this rank sent.
    """
    n, rank = ctx.size, ctx.rank
    dtype = y.dtype
    plan = _ring_plan(ctx, codec, y, seg_bytes, rank, True)
    nseg, segb = plan.nseg, plan.segb

    def finish(acc: np.ndarray, b: int, j: int, lo: int, hi: int) -> None:
        """Encode the complete sum of (b, j) into the gather area; decode it as the result."""
        payload = plan.encode(codec, acc, plan.gather_region(b, j), b, j)
        codec.decode(payload, hi - lo, dtype, out=out[lo:hi])
        if res is not None:
            plan.xp.subtract(acc, out[lo:hi], out=res[lo:hi])

    if n == 1:
        for j in range(nseg):
            lo, hi = segb[0][j], segb[0][j + 1]
            finish(y[lo:hi], 0, j, lo, hi)
        return Sent()

    def decode(b: int, j: int) -> None:
        lo, hi = segb[b][j], segb[b][j + 1]
        codec.decode(plan.views(plan.gather_region(b, j), b, j), hi - lo, dtype,
                     out=out[lo:hi])

    # uncompressed ring: every block but (rank+1) in the reduce-scatter, but (rank+2) in
    # the all-gather
    blk = [segb[b][-1] - segb[b][0] for b in range(n)]
    dense = (2 * y.size - blk[(rank + 1) % n] - blk[(rank + 2) % n]) * dtype.itemsize
    sreqs, rs_bytes = _reduce_scatter_phase(ctx, codec, plan, y, res, finish)
    # all-gather of the final payloads; rank owns block (rank + 1) % n
    agreqs, ag_bytes = gather_phase(ctx, plan.gather_region, (rank + 1) % n, nseg, TAG_AG,
                                    arrived=decode)
    sreqs += agreqs
    waiting.waitall(sreqs)
    return Sent(rs_bytes + ag_bytes, len(sreqs), dense)


def dense_reduce_scatter(ctx: Any, codec: Codec, y: np.ndarray, res: np.ndarray | None,
                         out: np.ndarray, seg_bytes: int) -> Sent:
    """The compressed ring reduce-scatter of ``y``: this rank's block (``rank``, of
    ``block_bounds(y.size, n)``) of the sum into ``out``, kept exact (never encoded).

    The ring of :func:`dense_ring`'s first phase, starting one block earlier (rank ``r``
    encodes block ``r - 1`` first) so that rank ``r`` completes block ``r``. ``res``: what
    this rank's encodings dropped (every block but its own; zero on its own block).
    ``out`` may be the first elements of ``y`` (in place): block ``rank``'s sum is written
    at the last step, after every other block of ``y`` was read.

    Returns:
        What this rank sent (``dense``: an uncompressed ring reduce-scatter).
    """
    n, rank = ctx.size, ctx.rank
    plan = _ring_plan(ctx, codec, y, seg_bytes, (rank - 1) % n, False)
    base = plan.segb[rank][0]

    def finish(acc: np.ndarray, b: int, j: int, lo: int, hi: int) -> None:
        plan.xp.copyto(out[lo - base:hi - base], acc)
        if res is not None:
            res[lo:hi] = 0

    if n == 1:
        finish(y, 0, 0, 0, y.size)
        return Sent()
    sreqs, sent_bytes = _reduce_scatter_phase(ctx, codec, plan, y, res, finish)
    waiting.waitall(sreqs)
    dense = (y.size - out.size) * y.dtype.itemsize
    return Sent(sent_bytes, len(sreqs), dense)


# ---------------------------------------------------------------------------------------
# every codec: all-gather of encoded blocks

def payload_allgather(ctx: Any, codec: Codec, y: np.ndarray, res: np.ndarray | None,
                      out: np.ndarray) -> Sent:
    """The compressed all-gather: this rank encodes ``y`` (its block) once, the payloads
    go around a ring, and every rank decodes every block (its own too) from the same bytes
    into ``out`` (``n`` blocks of ``y.size``). ``res``: ``y`` minus its decoded payload.
    ``y`` may be ``out``'s block ``rank`` (it is read whole before that block is written).

    Returns:
        What this rank sent (``dense``: an uncompressed ring all-gather).
    """
    n, rank = ctx.size, ctx.rank
    m, dtype = y.size, y.dtype
    layout = codec.layout(m, dtype)
    nbytes = layout_nbytes(layout)
    area = ctx.plan(("compression.allgather", type(codec), codec.name, m, dtype.str),
                    lambda: np.empty(n * nbytes, dtype=np.uint8))
    xp = namespace.array_module(y)

    def region(b: int, j: int = 0) -> np.ndarray:
        return area[b * nbytes:(b + 1) * nbytes]

    def arrived(b: int, j: int = 0) -> None:
        codec.decode(payload_views(layout, region(b)), m, dtype, out=out[b * m:(b + 1) * m])

    def mine() -> None:
        own = out[rank * m:(rank + 1) * m]
        codec.decode(payload, m, dtype, out=own)
        if res is not None:
            xp.subtract(y, own, out=res)

    payload = encode_to_host(codec, y, layout, region(rank))
    sreqs, sent_bytes = gather_phase(ctx, region, rank, 1, TAG_GATHER, mine, arrived)
    waiting.waitall(sreqs)
    return Sent(sent_bytes, len(sreqs), (n - 1) * m * dtype.itemsize)


# ---------------------------------------------------------------------------------------
# sparse codecs: all-gather of (index, value) payloads, summed in rank order

def add_pairs(codec: Codec, payload: tuple, out: Any) -> None:
    """``out[indices] += values`` of a sparse payload (host), on ``out``'s side (only the
    pairs are copied to a device)."""
    idx, vals = codec.indices_values(payload)
    idx, vals = namespace.to_side(idx, out), namespace.to_side(vals, out)
    out[idx] += vals  # indices of one payload are distinct

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

    def region(q: int, j: int = 0) -> np.ndarray:
        return area[q * nbytes:(q + 1) * nbytes]

    payload = encode_to_host(codec, y, layout, region(rank))
    sreqs, sent_bytes = gather_phase(ctx, region, rank, 1, TAG_SPARSE,
                                     lambda: keep_residual(codec, payload, y, res, 0, out))
    out.fill(0)
    for q in range(n):
        add_pairs(codec, payload_views(layout, region(q)), out)
    waiting.waitall(sreqs)
    return Sent(sent_bytes, len(sreqs), 2 * (n - 1) * y.size * dtype.itemsize // n)


def flat_allreduce(ctx: Any, codec: Codec, y: np.ndarray, res: np.ndarray | None,
                   out: np.ndarray, seg_bytes: int) -> Sent:
    """The flat compressed all-reduce: :func:`dense_ring` or :func:`sparse_allgather`."""
    if codec.dense:
        return dense_ring(ctx, codec, y, res, out, seg_bytes)
    return sparse_allgather(ctx, codec, y, res, out)
