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
encodings dropped. Device arrays (CuPy, ``__cuda_array_interface__``) run the flat layout
on the device, only payload bytes crossing to the host buffers MPI sends (:mod:`.ring`);
``auto`` is flat for them and ``node`` raises ``ValueError``. :func:`last_stats` reports
the bytes a rank sent, inside its node and to other nodes.
"""
from __future__ import annotations

from typing import Any, Hashable

import numpy as np

from .. import validation
from ..context import get_context, resolve_comm
from .arguments import (DEFAULT_SEGMENT_BYTES, agreed, array_view, check_side, compensated,
                        feedback_store, named_codec, resolve_op, segment_size)
from . import namespace
from .auto import Auto, resolve
from .node import check_layout, flat_split, node_allreduce, resolve_layout
from .ring import TAG_AG, TAG_RS, TAG_SPARSE, flat_allreduce
from .stats import AllreduceStats, CollectiveStats, fill, last_stats, record

__all__ = ["allreduce", "AllreduceStats", "last_stats", "TAG_RS", "TAG_AG", "TAG_SPARSE",
           "DEFAULT_SEGMENT_BYTES"]


# ---------------------------------------------------------------------------------------
# public entry point

def allreduce(sendbuf: Any, recvbuf: Any = None, op: Any = "sum", comm: Any = None,
              compression: Any = "int8", feedback: Any = None, key: Hashable = None,
              segment_bytes: int | None = None, check: bool = True,
              layout: str = "auto") -> Any:
    """All-reduce float32/float64 data with a codec on the wire.

    Args:
        sendbuf: this rank's contribution (numpy or device array, any shape), or
            ``IN_PLACE``/``None`` to reduce ``recvbuf`` in place.
        recvbuf: the output (same size and dtype); allocated (shaped like ``sendbuf``)
            when ``None`` and ``sendbuf`` is an array.
        op: ``"sum"`` or ``"average"`` (sum, then one division by the world size).
        comm: mpi4py intracommunicator (``None``: ``COMM_WORLD``).
        compression: a codec name (``"none"``, ``"fp16"``, ``"bf16"``, ``"int8"``,
            ``"onebit"``, ``"topk:RATIO"``, ``"randomk:RATIO"``), a
            :class:`~mpicoll.compression.codecs.Codec`, or ``"auto"``
            (:class:`~mpicoll.compression.auto.Auto`): the candidate codec the time model
            predicts fastest for this size and layout, the same on every rank
            (:func:`last_stats` says which and why; docs/compression.md, *Automatic
            choice*).
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

    def validate() -> tuple[tuple, dict]:
        codec = named_codec(compression)
        opname = resolve_op(op, "all-reduce")
        check_layout(layout)
        x, out, in_place = validation.elementwise(sendbuf, recvbuf, array_view,
                                                  check_input=codec.check_dtype,
                                                  check_pair=check_side)
        result = recvbuf
        if out is None:
            out = namespace.array_module(x).empty(x.size, dtype=x.dtype)
            result = out.reshape(np.shape(sendbuf))
        owner = result if in_place else sendbuf
        store, fb_key = feedback_store(codec, feedback, key, owner, x)
        seg = segment_size(segment_bytes)
        shape = resolve_layout(ctx, layout, device=not namespace.is_host_module(
            namespace.array_module(x)))
        return ((codec, opname, x, out, result, store, fb_key, seg, shape, owner),
                dict(count=x.size, dtype=str(x.dtype), op=opname, algorithm=codec.name,
                     resolved=f"layout={shape}", segment_bytes=seg))

    codec, opname, x, out, result, store, fb_key, seg, shape, owner = agreed(
        ctx, check, "compression.allreduce", validate)
    choice = None
    if isinstance(codec, Auto):     # every rank is here: the agreement passed
        codec, choice = resolve(ctx, codec, x, shape, seg, feedback)
        store, fb_key = feedback_store(codec, feedback, key, owner, x)
    stats = record(CollectiveStats(codec.name, x.size, str(x.dtype), ctx.size, shape,
                                   choice=choice))
    if x.size == 0:
        return result
    y, res = compensated(store, fb_key, x)
    if shape == "node":
        intra, inter = node_allreduce(ctx, codec, y, res, out, seg)
    else:
        intra, inter = flat_split(ctx, flat_allreduce(ctx, codec, y, res, out, seg))
    fill(stats, intra, inter)
    if opname == "average":
        namespace.array_module(out).divide(out, ctx.size, out=out)
    return result
