"""Compressed all-gather: every rank's block, encoded once by its owner, to every rank.

Each rank encodes its own block once (with error feedback on that block when asked), the
payloads go around a ring as bytes (:func:`.ring.payload_allgather`) and every rank decodes
every block, its own included, from the same bytes: the result is bit-identical on every
rank. Any codec (a sparse codec's block decodes to its ``k`` pairs, zeros elsewhere).

Use: gathering parameters or activations in 16 or 8 bits (ZeRO-style parameter
all-gather). **Error feedback is off by default** here (``feedback=None``): the residual of
a parameter gather would be added to the next gather of the same parameters, which have
changed in between (the optimizer updated them exactly); what was lost is not owed to a
later call of the same meaning, as a gradient's is. ``feedback=True`` or an
:class:`ErrorFeedback` turn it on (the residual: this rank's block minus its decoded
payload).
"""
from __future__ import annotations

from typing import Any, Hashable

import numpy as np

from .. import validation
from ..context import get_context, resolve_comm
from .arguments import (agreed, array_view, check_side, compensated, feedback_store,
                        named_codec)
from . import namespace
from .auto import Auto, resolve
from .node import flat_split
from .ring import payload_allgather
from .stats import CollectiveStats, fill, record

__all__ = ["allgather"]


def allgather(sendbuf: Any, recvbuf: Any = None, comm: Any = None, compression: Any = "fp16",
              feedback: Any = None, key: Hashable = None, check: bool = True) -> Any:
    """All-gather float32/float64 blocks (the same size on every rank) with a codec on the
    wire, in rank order.

    Args:
        sendbuf: this rank's block (numpy or device array, any shape), or
            ``IN_PLACE``/``None`` when it is already at position ``rank`` of ``recvbuf``.
        recvbuf: ``size`` times as many elements, same dtype; ``None`` allocates one shaped
            ``(size * sendbuf.shape[0], *sendbuf.shape[1:])`` (``(size,)`` for 0-d input).
        comm, compression, key, check: as for :func:`~mpicoll.compression.allreduce`.
        feedback: error feedback on this rank's block. ``None`` (default) and ``False``:
            off (see the module docstring); ``True``: on, the residual kept with the input
            array object; an :class:`ErrorFeedback`: on, kept there under ``key``.
    Returns:
        The gathered array (``recvbuf`` when given), the same bits on every rank (a rank's
        own block too is its decoded payload). :func:`~mpicoll.compression.last_stats`
        then reports the bytes this rank sent.
    Raises:
        TypeError, ValueError: bad arguments, naming the argument.
        mpicoll.RemoteError, mpicoll.MismatchError: with ``check``, another rank's bad
            arguments or ranks that disagree (block size, dtype, codec).
    """
    ctx = get_context(resolve_comm(comm))

    def validate() -> tuple[tuple, dict]:
        codec = named_codec(compression)
        x, out, in_place = validation.allgather(sendbuf, recvbuf, ctx.rank, ctx.size,
                                                array_view, check_input=codec.check_dtype,
                                                check_pair=check_side)
        result = recvbuf
        if out is None:
            result = namespace.array_module(x).empty(
                validation.gathered_shape(np.shape(sendbuf), ctx.size), dtype=x.dtype)
            out = result.reshape(-1)
        owner = recvbuf if in_place else sendbuf
        store, fb_key = feedback_store(codec, feedback, key, owner, x, default=False)
        return ((codec, x, out, result, store, fb_key),
                dict(count=x.size, dtype=str(x.dtype), algorithm=codec.name))

    codec, x, out, result, store, fb_key = agreed(ctx, check, "compression.allgather", validate)
    choice = None
    if isinstance(codec, Auto):     # every rank is here: the agreement passed
        codec, choice = resolve(ctx, codec, x, "flat", 0, store is not None, "allgather")
    stats = record(CollectiveStats(codec.name, x.size, str(x.dtype), ctx.size,
                                   collective="allgather", choice=choice))
    if x.size == 0:
        return result
    y, res = compensated(store, fb_key, x)
    fill(stats, *flat_split(ctx, payload_allgather(ctx, codec, y, res, out)))
    return result
