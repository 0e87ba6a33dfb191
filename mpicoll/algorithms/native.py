"""The MPI library's own collectives, registered as algorithm ``"native"`` (the baseline).

Data moves with the predefined MPI datatype of the dtype where MPI has one that the op
applies to; otherwise (float16, bool, ...) with a contiguous byte datatype and an MPI op
created from the mpicoll op, so native handles every dtype mpicoll does. Which path a call
takes depends only on dtype and op, so it is the same on every rank.

Each spec finds the datatype, count and op once and returns a ``build(*buffers)`` of the
MPI method's arguments, so a planned call (``bind``) has them ready and a call by shape
(``bind_buffers``, :mod:`mpicoll.fastpath`) only puts the new arrays in.

On a communicator whose context is ``nonblocking`` (a torch.distributed group's, whose
operations run on a runtime lane with the group's timeout as the deadline), the calls
start the non-blocking forms (``MPI_Iallreduce``, ...) and wait through
:func:`mpicoll.waiting.wait`: on a thread that polls (yielding, never sleeping: one MPI
call that moves data in many steps needs a poll for each) a peer that never joins ends
in the lane's timeout instead of a wait as long as the peer lives. Chosen per
communicator, not per thread: every rank then calls the same form (a non-blocking
collective never matches a blocking one), and the caller's fast path on other
communicators calls the blocking method directly, as before.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..context import CommContext
from ..waiting import wait
from .registry import register

__all__ = ["native_types"]

_lock = threading.Lock()
_user_ops: dict[Any, tuple[MPI.Datatype, MPI.Op]] = {}

# dtype kinds each predefined MPI op handles in MPI's C types (float16 and bool excluded).
_NATIVE_KINDS = {"sum": "iufc", "prod": "iufc", "min": "iuf", "max": "iuf",
                 "average": "iufc", "band": "iu", "bor": "iu", "bxor": "iu"}


def _user_op(dtype: np.dtype, op: Any) -> tuple[MPI.Datatype, MPI.Op]:
    key = (dtype, getattr(op, "name", id(op)))
    with _lock:
        found = _user_ops.get(key)
        if found is None:
            datatype = MPI.BYTE.Create_contiguous(dtype.itemsize).Commit()

            def apply(inbuf: Any, inoutbuf: Any, _datatype: Any) -> None:
                a = np.frombuffer(inbuf, dtype=dtype)
                b = np.frombuffer(inoutbuf, dtype=dtype)
                op.combine(a, b, b)

            found = _user_ops[key] = (datatype, MPI.Op.Create(apply, commute=True))
        return found


@functools.lru_cache(maxsize=None)
def native_types(dtype: np.dtype, op: Any) -> tuple[MPI.Datatype, MPI.Op]:
    """The (datatype, op) pair native MPI reduces ``dtype`` with under ``op`` (cached)."""
    name = getattr(op, "name", None)
    if name in _NATIVE_KINDS and dtype.kind in _NATIVE_KINDS[name] and dtype != np.float16:
        datatype = MPI._typedict.get(dtype.char)  # the predefined type (dtlib's are dups)
        if datatype is not None and dtype.byteorder in "=|":
            return datatype, op.mpi_op
    return _user_op(dtype, op)


def _form(ctx: CommContext, method: Callable) -> Callable[..., None]:
    """``method`` (a blocking collective of ``mpi4py.MPI.Comm``), or where ``ctx`` is
    ``nonblocking`` its non-blocking form (``Allreduce`` -> ``Iallreduce``) waited for
    through :func:`mpicoll.waiting.wait`."""
    if not ctx.nonblocking:
        return method
    name = method.__name__
    start = getattr(method.__self__, "I" + name[0].lower() + name[1:])
    return lambda *args: wait(start(*args), naps=False)


def _native(collective: str, buffers: int = 2) -> Callable[[Callable], Callable]:
    """Register ``spec`` as ``"native"``: ``spec(ctx, *args)`` returns the MPI method and
    ``build(*buffers)``, which makes the method's arguments for those buffers (the
    datatype, count and op found once, from the ``buffers`` arrays among ``args``).

    The registered run function calls the method on its own arguments; its ``bind``
    returns the call with the arguments built once (the identity cache:
    :func:`mpicoll.algorithms.registry.bind`); its ``bind_buffers`` returns
    ``run(a, b)``, the same call on other arrays of the same size and dtype (C-contiguous,
    any shape; ``b`` ignored where the collective has one buffer): the calls by shape.
    """
    def deco(spec: Callable) -> Callable:
        def bind(ctx: CommContext, *args: Any) -> Callable[[], Any]:
            method, build = spec(ctx, *args)
            return functools.partial(_form(ctx, method), *build(*args[:buffers]))

        def run(ctx: CommContext, *args: Any) -> None:
            bind(ctx, *args)()

        def bind_buffers(ctx: CommContext, *args: Any) -> Callable[[Any, Any], None]:
            method, build = spec(ctx, *args)
            call = _form(ctx, method)
            if buffers == 1:
                return lambda a, _b: call(*build(a))
            return lambda a, b: call(*build(a, b))

        run.__name__ = run.__qualname__ = spec.__name__
        run.__doc__ = spec.__doc__
        run.bind = bind
        run.bind_buffers = bind_buffers
        return register(collective, "native")(run)

    return deco


@_native("allreduce")
def native_allreduce(ctx: CommContext, send: Any, recv: Any, op: Any) -> tuple:
    """``MPI_Allreduce``."""
    datatype, mpi_op = native_types(recv.dtype, op)
    count = recv.size
    if send is recv:
        return ctx.comm.Allreduce, lambda s, r: (MPI.IN_PLACE, [r, count, datatype], mpi_op)
    return ctx.comm.Allreduce, lambda s, r: ([s, count, datatype], [r, count, datatype],
                                             mpi_op)


@_native("reduce_scatter")
def native_reduce_scatter(ctx: CommContext, send: Any, recv: Any, op: Any) -> tuple:
    """``MPI_Reduce_scatter`` with ``array_split`` counts."""
    from .plans import rank_blocks  # noqa: PLC0415

    datatype, mpi_op = native_types(send.dtype, op)
    bounds = rank_blocks(ctx, send.size)
    counts = [bounds[i + 1] - bounds[i] for i in range(ctx.size)]
    total, mine = send.size, recv.size
    if mine == 0:  # an empty view into sendbuf's memory is "aliased" for MPICH
        empty = [np.empty(0, dtype=recv.dtype), 0, datatype]
        return ctx.comm.Reduce_scatter, lambda s, r: ([s, total, datatype], empty, counts,
                                                      mpi_op)
    return ctx.comm.Reduce_scatter, lambda s, r: ([s, total, datatype], [r, mine, datatype],
                                                  counts, mpi_op)


@_native("allgather")
def native_allgather(ctx: CommContext, send: Any, recv: Any) -> tuple:
    """``MPI_Allgather`` (as bytes)."""
    nbytes = recv.nbytes // ctx.size
    if send is None:
        return ctx.comm.Allgather, lambda s, r: (MPI.IN_PLACE, [r, nbytes, MPI.BYTE])
    return ctx.comm.Allgather, lambda s, r: ([s, nbytes, MPI.BYTE], [r, nbytes, MPI.BYTE])


@_native("broadcast", buffers=1)
def native_broadcast(ctx: CommContext, buf: Any, root: int) -> tuple:
    """``MPI_Bcast`` (as bytes)."""
    nbytes = buf.nbytes
    return ctx.comm.Bcast, lambda b: ([b, nbytes, MPI.BYTE], root)


@_native("reduce")
def native_reduce(ctx: CommContext, send: Any, recv: Any, op: Any, root: int) -> tuple:
    """``MPI_Reduce``."""
    datatype, mpi_op = native_types(send.dtype, op)
    count = send.size
    if ctx.rank != root:
        return ctx.comm.Reduce, lambda s, r: ([s, count, datatype], None, mpi_op, root)
    if send is recv:
        return ctx.comm.Reduce, lambda s, r: (MPI.IN_PLACE, [r, count, datatype], mpi_op,
                                              root)
    return ctx.comm.Reduce, lambda s, r: ([s, count, datatype], [r, count, datatype], mpi_op,
                                          root)
