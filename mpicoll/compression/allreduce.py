"""Compressed all-reduce over mpicoll's private communicator.

Dense codecs (``none``, ``fp16``, ``bf16``, ``int8``, ``onebit``) run a ring:

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

Messages use tags 101-103 on the communicator's private duplicate (``CommContext.p2p``).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Hashable

import numpy as np
from mpi4py import MPI

from .. import buffers
from ..checked import agree
from ..context import get_context, resolve_comm
from ..partition import block_bounds, segment_bounds
from .codecs import Codec, get_codec, layout_nbytes, payload_views
from .feedback import ErrorFeedback, tensor_feedback

__all__ = ["allreduce", "AllreduceStats", "last_stats", "TAG_RS", "TAG_AG", "TAG_SPARSE",
           "DEFAULT_SEGMENT_BYTES"]

TAG_RS = 101      #: ring reduce-scatter of encoded segments
TAG_AG = 102      #: ring all-gather of final encoded segments
TAG_SPARSE = 103  #: all-gather of sparse (index, value) payloads

#: Largest segment of the uncompressed input per message (bytes).
DEFAULT_SEGMENT_BYTES = 4 << 20

OPS = ("sum", "average")


@dataclass
class AllreduceStats:
    """What one compressed all-reduce sent from this rank.

    Attributes:
        codec: the codec's name.
        count, dtype, size: elements, input dtype, world size.
        bytes_sent: payload bytes this rank sent (both phases).
        messages: messages this rank sent.
        dense_bytes: bytes the same schedule sends uncompressed (ring all-reduce:
            ``2 (n-1)/n`` of the vector, for sparse codecs an uncompressed ring all-reduce).
    """

    codec: str
    count: int
    dtype: str
    size: int
    bytes_sent: int = 0
    messages: int = 0
    dense_bytes: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """``dense_bytes / bytes_sent`` (how many times fewer bytes; 1.0 if nothing sent)."""
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else 1.0


_local = threading.local()


def last_stats() -> AllreduceStats | None:
    """Statistics of this thread's latest compressed all-reduce (``None`` before any)."""
    return getattr(_local, "stats", None)


# ---------------------------------------------------------------------------------------
# validation

def _resolve_op(op: Any) -> str:
    if op is MPI.SUM:
        return "sum"
    if not isinstance(op, str):
        raise TypeError(f"op must be 'sum' or 'average', not {type(op).__name__}")
    if op not in OPS:
        raise ValueError(f"unknown op={op!r}; the compressed all-reduce supports "
                         f"'sum' and 'average'")
    return op


#: Codecs built from names, one per name and process: stateful codecs (randomk's step,
#: stochastic int8's generator) then advance from call to call, identically on every rank
#: that makes the same sequence of calls.
_named_codecs: dict[str, Codec] = {}


def _codec(spec: Any) -> Codec:
    if isinstance(spec, str):
        codec = _named_codecs.get(spec)
        if codec is None:
            codec = _named_codecs[spec] = get_codec(spec)
        return codec
    return get_codec(spec)


def _validate(sendbuf: Any, recvbuf: Any, op: Any, compression: Any, feedback: Any,
              segment_bytes: Any) -> tuple:
    codec = _codec(compression)
    opname = _resolve_op(op)
    if recvbuf is not None and recvbuf is sendbuf:
        sendbuf = None  # the same array: in place
    if buffers.is_in_place(sendbuf):
        if recvbuf is None:
            raise ValueError("recvbuf is required when sendbuf is IN_PLACE")
        out = _numpy_view(recvbuf, "recvbuf", writable=True)
        codec.check_dtype(out.dtype, "recvbuf")
        x = out
        owner = recvbuf
    else:
        x = _numpy_view(sendbuf, "sendbuf")
        codec.check_dtype(x.dtype, "sendbuf")
        owner = sendbuf
        if recvbuf is None:
            out = np.empty(x.size, dtype=x.dtype)
            recvbuf = out.reshape(np.shape(sendbuf))
        else:
            out = _numpy_view(recvbuf, "recvbuf", writable=True)
            if out.dtype != x.dtype:
                raise TypeError(f"recvbuf has dtype {out.dtype}; it must match sendbuf "
                                f"({x.dtype})")
            if out.size != x.size:
                raise ValueError(f"recvbuf has {out.size} elements; it must have as many "
                                 f"as sendbuf ({x.size})")
            if out is not x and np.shares_memory(out, x):
                raise ValueError("recvbuf overlaps sendbuf; pass IN_PLACE as sendbuf to "
                                 "reduce in place")
    if not (feedback is None or isinstance(feedback, (bool, ErrorFeedback))):
        raise TypeError(f"feedback must be None, True, False or an ErrorFeedback, "
                        f"not {type(feedback).__name__}")
    if segment_bytes is None:
        seg = DEFAULT_SEGMENT_BYTES
    elif isinstance(segment_bytes, bool) or not isinstance(segment_bytes, (int, np.integer)):
        raise TypeError(f"segment_bytes must be an int, not {type(segment_bytes).__name__}")
    elif segment_bytes < 1:
        raise ValueError(f"segment_bytes must be positive, got {segment_bytes}")
    else:
        seg = int(segment_bytes)
    return codec, opname, x, out, recvbuf, owner, seg


def _numpy_view(a: Any, argname: str, writable: bool = False) -> np.ndarray:
    if buffers.is_array(a) and not isinstance(a, np.ndarray):
        raise TypeError(f"{argname}: the compressed all-reduce takes numpy arrays "
                        f"(device arrays are not supported yet)")
    return buffers.flat_view(a, argname, writable=writable)


def _feedback_store(codec: Codec, feedback: Any, key: Hashable, owner: Any, x: np.ndarray
                    ) -> tuple[ErrorFeedback | None, Hashable]:
    """Where this call's residual lives: ``(store, key)``, or ``(None, None)`` when off.

    Raises:
        ValueError: the residual stored under the key does not match ``x`` (checked here,
            before any message, so the error cannot strand the other ranks).
    """
    on = codec.lossy if feedback is None else feedback if isinstance(feedback, bool) else True
    if not on:
        return None, None
    if isinstance(feedback, ErrorFeedback):
        store, fb_key = feedback, key
    else:
        store = tensor_feedback()
        fb_key = store.key_for(owner)
    store.check(fb_key, x)
    return store, fb_key


# ---------------------------------------------------------------------------------------
# public entry point

def allreduce(sendbuf: Any, recvbuf: Any = None, op: Any = "sum", comm: Any = None,
              compression: Any = "int8", feedback: Any = None, key: Hashable = None,
              segment_bytes: int | None = None, check: bool = True) -> Any:
    """All-reduce float32/float64 data with a codec on the wire.

    Args:
        sendbuf: this rank's contribution (numpy array, any shape), or ``IN_PLACE``/``None``
            to reduce ``recvbuf`` in place.
        recvbuf: the output (same size and dtype); allocated (shaped like ``sendbuf``)
            when ``None`` and ``sendbuf`` is an array.
        op: ``"sum"`` or ``"average"`` (sum, then one division by the world size).
        comm: mpi4py intracommunicator (``None``: ``COMM_WORLD``).
        compression: a codec name (``"none"``, ``"fp16"``, ``"bf16"``, ``"int8"``,
            ``"onebit"``, ``"topk:RATIO"``, ``"randomk:RATIO"``) or a
            :class:`~mpicoll.compression.codecs.Codec`.
        feedback: error feedback. ``None`` (default): on for lossy codecs, with the
            residual kept with the input array object (freed with it; see
            :func:`~mpicoll.compression.feedback.tensor_feedback`); ``True`` the same for
            any codec; ``False`` off; an :class:`ErrorFeedback` keeps it there under ``key``.
        key: the residual's key in an explicit ``feedback`` object.
        segment_bytes: largest piece of the uncompressed input per message (default 4 MiB).
        check: agree with every rank before sending anything (one all-gather of a few
            integers): a rank with bad arguments raises its error and every other rank
            :class:`mpicoll.RemoteError`; ranks passing different counts, dtypes, ops,
            codecs or segment sizes all raise :class:`mpicoll.MismatchError`. With
            ``check=False`` a rank raises only its own argument errors (before any message),
            and ranks that disagree fail inside MPI or wait.
    Returns:
        ``recvbuf`` (the allocated one if it was ``None``), holding the same bits on every
        rank. :func:`last_stats` then reports the bytes this rank sent.
    Raises:
        TypeError, ValueError: bad arguments, naming the argument (unknown codec, integer
            data, ratio outside (0, 1], mismatched ``recvbuf``...).
        mpicoll.RemoteError, mpicoll.MismatchError: with ``check``, another rank's bad
            arguments or ranks that disagree.
    """
    comm = resolve_comm(comm)
    ctx = get_context(comm)
    error: BaseException | None = None
    try:
        codec, opname, x, out, result, owner, seg = _validate(
            sendbuf, recvbuf, op, compression, feedback, segment_bytes)
        store, fb_key = _feedback_store(codec, feedback, key, owner, x)
    except (TypeError, ValueError) as exc:
        if not check:
            raise
        error = exc
    if check:
        if error is not None:
            agree(ctx, error, collective="compression.allreduce")
        agree(ctx, None, collective="compression.allreduce", count=x.size, dtype=str(x.dtype),
              op=opname, algorithm=codec.name, segment_bytes=seg)

    n = ctx.size
    stats = AllreduceStats(codec.name, x.size, str(x.dtype), n)
    _local.stats = stats
    if x.size == 0:
        return result
    if store is not None:
        # y = x + old residual, computed in the residual's own storage: each element of y is
        # read once (when this rank encodes its block) and only then overwritten with the
        # new residual, so no extra vector is needed
        res = store.buffer(fb_key, x)
        np.add(res, x, out=res)
        y = res
    else:
        y, res = x, None
    if codec.dense:
        _dense_ring(ctx, codec, y, res, out, seg, stats)
    else:
        _sparse_allgather(ctx, codec, y, res, out, stats)
    if opname == "average":
        np.divide(out, n, out=out)
    return result


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


def _dense_ring(ctx: Any, codec: Codec, y: np.ndarray, res: np.ndarray | None,
                out: np.ndarray, seg_bytes: int, stats: AllreduceStats) -> None:
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
    if n > 1:  # uncompressed ring: every block but (rank+1) in the reduce-scatter, but
        # (rank+2) in the all-gather
        blk = [segb[b][-1] - segb[b][0] for b in range(n)]
        stats.dense_bytes = (2 * y.size - blk[(rank + 1) % n] - blk[(rank + 2) % n]) \
            * dtype.itemsize

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
        return

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
    stats.bytes_sent = sent_bytes
    stats.messages = len(sreqs)


# ---------------------------------------------------------------------------------------
# sparse codecs: all-gather of (index, value) payloads, summed in rank order

def _sparse_allgather(ctx: Any, codec: Codec, y: np.ndarray, res: np.ndarray | None,
                      out: np.ndarray, stats: AllreduceStats) -> None:
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
    stats.bytes_sent = sent_bytes
    stats.messages = len(sreqs)
    stats.dense_bytes = 2 * (n - 1) * y.size * dtype.itemsize // n
