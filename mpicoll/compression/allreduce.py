"""Compressed all-reduce over mpicoll's private communicator: arguments, agreement, layout.

Two layouts (``layout=``):

- ``"flat"``: one compressed schedule over all ranks (:mod:`.ring`): for dense codecs a
  ring whose reduce-scatter decodes, adds and re-encodes at every hop, then an all-gather
  of the encoded shards; for sparse codecs an all-gather of (index, value) pairs.
- ``"node"``: uncompressed inside each node, compressed only between nodes
  (:mod:`.node`): reduce-scatter (or reduce) inside the node, the flat schedule on each
  node's shard among the nodes, all-gather (or broadcast) inside the node.
- ``"auto"`` (default): ``node`` when the communicator spans several nodes and some node
  holds more than one rank, else ``flat``.

Every rank gets the same bits; each rank's error feedback residual holds what its own
encodings dropped. :func:`last_stats` reports the bytes a rank sent, inside its node and
to other nodes.
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
from .codecs import Codec, get_codec
from .feedback import ErrorFeedback, tensor_feedback
from .node import check_layout, flat_crosses_nodes, node_allreduce, resolve_layout
from .ring import TAG_AG, TAG_RS, TAG_SPARSE, Sent, dense_ring, sparse_allgather

__all__ = ["allreduce", "AllreduceStats", "last_stats", "TAG_RS", "TAG_AG", "TAG_SPARSE",
           "DEFAULT_SEGMENT_BYTES"]

#: Largest segment of the uncompressed input per message (bytes).
DEFAULT_SEGMENT_BYTES = 4 << 20

OPS = ("sum", "average")


@dataclass
class AllreduceStats:
    """What one compressed all-reduce sent from this rank.

    Attributes:
        codec: the codec's name.
        count, dtype, size: elements, input dtype, world size.
        layout: ``"flat"`` or ``"node"`` (what ``layout=`` resolved to).
        bytes_sent: payload bytes this rank sent (every phase):
            ``intra_node_bytes + inter_node_bytes``.
        intra_node_bytes: the part sent to ranks on this rank's node (uncompressed in the
            node layout).
        inter_node_bytes: the part sent to ranks on other nodes.
        messages: messages this rank sent.
        dense_bytes: bytes the same schedule sends uncompressed (ring all-reduce:
            ``2 (n-1)/n`` of the vector, for sparse codecs an uncompressed ring all-reduce;
            in the node layout the intra-node phases plus that of the shard among nodes).
    """

    codec: str
    count: int
    dtype: str
    size: int
    layout: str = "flat"
    bytes_sent: int = 0
    intra_node_bytes: int = 0
    inter_node_bytes: int = 0
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
              segment_bytes: Any, layout: Any) -> tuple:
    codec = _codec(compression)
    opname = _resolve_op(op)
    check_layout(layout)
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
              segment_bytes: int | None = None, check: bool = True,
              layout: str = "auto") -> Any:
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
        layout: ``"auto"`` (default), ``"flat"`` or ``"node"``. ``flat``: one compressed
            ring (or sparse all-gather) over all ranks. ``node``: uncompressed inside each
            node, compressed between nodes only (docs/compression.md, *Node-aware
            layout*). ``auto``: ``node`` when the communicator spans several nodes and
            some node holds more than one rank, else ``flat``. Ranks must agree on what it
            resolves to (checked with ``check``).
    Returns:
        ``recvbuf`` (the allocated one if it was ``None``), holding the same bits on every
        rank. :func:`last_stats` then reports the bytes this rank sent.
    Raises:
        TypeError, ValueError: bad arguments, naming the argument (unknown codec, integer
            data, ratio outside (0, 1], mismatched ``recvbuf``, unknown ``layout``...).
        mpicoll.RemoteError, mpicoll.MismatchError: with ``check``, another rank's bad
            arguments or ranks that disagree.
    """
    comm = resolve_comm(comm)
    ctx = get_context(comm)
    error: BaseException | None = None
    try:
        codec, opname, x, out, result, owner, seg = _validate(
            sendbuf, recvbuf, op, compression, feedback, segment_bytes, layout)
        store, fb_key = _feedback_store(codec, feedback, key, owner, x)
    except (TypeError, ValueError) as exc:
        if not check:
            raise
        error = exc
    if error is None:
        shape = resolve_layout(ctx, layout)
    if check:
        if error is not None:
            agree(ctx, error, collective="compression.allreduce")
        agree(ctx, None, collective="compression.allreduce", count=x.size, dtype=str(x.dtype),
              op=opname, algorithm=codec.name, resolved=f"layout={shape}", segment_bytes=seg)

    n = ctx.size
    stats = AllreduceStats(codec.name, x.size, str(x.dtype), n, shape)
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
    if shape == "node":
        intra, inter = node_allreduce(ctx, codec, y, res, out, seg)
    else:
        if codec.dense:
            sent = dense_ring(ctx, codec, y, res, out, seg)
        else:
            sent = sparse_allgather(ctx, codec, y, res, out)
        crosses = flat_crosses_nodes(ctx)
        intra, inter = (Sent(), sent) if crosses else (sent, Sent())
    total = intra + inter
    stats.bytes_sent, stats.messages, stats.dense_bytes = total
    stats.intra_node_bytes, stats.inter_node_bytes = intra.bytes, inter.bytes
    if opname == "average":
        np.divide(out, n, out=out)
    return result
