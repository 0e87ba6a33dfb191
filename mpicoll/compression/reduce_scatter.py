"""Compressed reduce-scatter: rank ``i`` gets block ``i`` of the sum, a codec on the wire.

Blocks follow ``numpy.array_split`` (as :func:`mpicoll.reduce_scatter`). Dense codecs:
the re-encoding ring reduce-scatter of the compressed all-reduce (:mod:`.ring`), arranged
so that rank ``i`` completes block ``i``, which it keeps exact (no final encoding). Sparse
codecs: each rank sends each other rank only the (index, value) pairs of that rank's
block (:mod:`.sparse_scatter`).

Error feedback (on by default for lossy codecs, as for the all-reduce): a rank's residual
is one full vector, what its own encodings dropped: for every block but its own, the loss
of the one encoding it made of that block (its input, or the partial sum it forwarded);
zero on its own block. Summed over ranks, the residuals plus the gathered result equal the
sum of the compensated inputs.
"""
from __future__ import annotations

from typing import Any, Hashable

from .. import validation
from ..context import get_context, resolve_comm
from .arguments import (agreed, array_view, check_side, compensated, feedback_store,
                        named_codec, resolve_op, segment_size)
from . import namespace
from .auto import Auto, resolve
from .node import flat_split, node_peers
from .ring import dense_reduce_scatter
from .sparse_scatter import sparse_reduce_scatter
from .stats import CollectiveStats, fill, record

__all__ = ["reduce_scatter"]


def reduce_scatter(sendbuf: Any, recvbuf: Any = None, op: Any = "sum", comm: Any = None,
                   compression: Any = "int8", feedback: Any = None, key: Hashable = None,
                   segment_bytes: int | None = None, check: bool = True) -> Any:
    """Reduce-scatter float32/float64 data with a codec on the wire.

    Args:
        sendbuf: the full vector (numpy or device array, any shape), or ``IN_PLACE``/``None``
            to take it from ``recvbuf`` (the block is then left in its first elements, as MPI
            does).
        recvbuf: this rank's block (any shape with that many elements, same dtype);
            ``None`` allocates a flat array.
        op, comm, compression, key, check: as for :func:`~mpicoll.compression.allreduce`.
        feedback: error feedback, as for :func:`~mpicoll.compression.allreduce` (on by
            default for lossy codecs); the residual has the size of ``sendbuf``.
        segment_bytes: largest piece of the uncompressed input per message (default
            4 MiB; dense codecs).
    Returns:
        This rank's block of the result (``recvbuf`` when given; in place the first
        elements of ``recvbuf``). :func:`~mpicoll.compression.last_stats` then reports the
        bytes this rank sent.
    Raises:
        TypeError, ValueError: bad arguments, naming the argument (unknown codec, integer
            data, a ``recvbuf`` that is not this rank's block...).
        mpicoll.RemoteError, mpicoll.MismatchError: with ``check``, another rank's bad
            arguments or ranks that disagree.
    """
    ctx = get_context(resolve_comm(comm))

    def validate() -> tuple[tuple, dict]:
        codec = named_codec(compression)
        opname = resolve_op(op, "reduce-scatter")
        x, out, in_place = validation.reduce_scatter(sendbuf, recvbuf, ctx.rank, ctx.size,
                                                     array_view, check_input=codec.check_dtype,
                                                     check_pair=check_side)
        result = out if in_place else recvbuf
        if out is None:
            out = result = namespace.array_module(x).empty(
                validation.own_block(x.size, ctx.rank, ctx.size), dtype=x.dtype)
        owner = recvbuf if in_place else sendbuf
        store, fb_key = feedback_store(codec, feedback, key, owner, x)
        seg = segment_size(segment_bytes)
        return ((codec, opname, x, out, result, store, fb_key, seg, owner),
                dict(count=x.size, dtype=str(x.dtype), op=opname, algorithm=codec.name,
                     segment_bytes=seg))

    codec, opname, x, out, result, store, fb_key, seg, owner = agreed(
        ctx, check, "compression.reduce_scatter", validate)
    choice = None
    if isinstance(codec, Auto):     # every rank is here: the agreement passed
        codec, choice = resolve(ctx, codec, x, "flat", seg, feedback, "reduce_scatter")
        store, fb_key = feedback_store(codec, feedback, key, owner, x)
    stats = record(CollectiveStats(codec.name, x.size, str(x.dtype), ctx.size,
                                   collective="reduce_scatter", choice=choice))
    if x.size == 0:
        return result
    y, res = compensated(store, fb_key, x)
    # in place without feedback ``out`` is the start of ``y``: the dense ring reads every
    # other block before it writes its own (safe); the sparse sum writes before it reads
    xp = namespace.array_module(out)
    if codec.dense:
        intra, inter = flat_split(ctx, dense_reduce_scatter(ctx, codec, y, res, out, seg))
    else:
        target = xp.empty_like(out) if xp.may_share_memory(out, y) else out
        intra, inter = sparse_reduce_scatter(ctx, codec, y, res, target, node_peers(ctx))
        if target is not out:
            xp.copyto(out, target)
    fill(stats, intra, inter)
    if opname == "average":
        xp.divide(out, ctx.size, out=out)
    return result
