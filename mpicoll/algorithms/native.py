"""The MPI library's own collectives, registered as algorithm ``"native"`` (the baseline).

Data moves with the predefined MPI datatype of the dtype where MPI has one that the op
applies to; otherwise (float16, bool, ...) with a contiguous byte datatype and an MPI op
created from the mpicoll op, so native handles every dtype mpicoll does. Which path a call
takes depends only on dtype and op, so it is the same on every rank.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..context import CommContext
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


_types_cache: dict[Any, tuple[MPI.Datatype, MPI.Op]] = {}


def native_types(dtype: np.dtype, op: Any) -> tuple[MPI.Datatype, MPI.Op]:
    """The (datatype, op) pair native MPI reduces ``dtype`` with under ``op`` (cached)."""
    key = (dtype, op)
    found = _types_cache.get(key)
    if found is None:
        found = _types_cache[key] = _native_types(dtype, op)
    return found


def _native_types(dtype: np.dtype, op: Any) -> tuple[MPI.Datatype, MPI.Op]:
    name = getattr(op, "name", None)
    if name in _NATIVE_KINDS and dtype.kind in _NATIVE_KINDS[name] and dtype != np.float16:
        datatype = MPI._typedict.get(dtype.char)  # the predefined type (dtlib's are dups)
        if datatype is not None and dtype.byteorder in "=|":
            return datatype, op.mpi_op
    return _user_op(dtype, op)


def _typed(buf: Any, datatype: MPI.Datatype) -> list:
    return [buf, buf.size, datatype]


def _native(collective: str) -> Callable[[Callable], Callable]:
    """Register ``spec`` (returning the MPI method and its arguments) as ``"native"``.

    The registered run function calls the method; its ``bind`` returns the call with its
    argument specs built once (for cached calls: :func:`mpicoll.algorithms.registry.bind`).
    """
    def deco(spec: Callable) -> Callable:
        def run(ctx: CommContext, *args: Any) -> None:
            method, margs = spec(ctx, *args)
            method(*margs)

        def bind(ctx: CommContext, *args: Any) -> Callable[[], Any]:
            method, margs = spec(ctx, *args)
            return functools.partial(method, *margs)

        run.__name__ = run.__qualname__ = spec.__name__
        run.__doc__ = spec.__doc__
        run.bind = bind
        return register(collective, "native")(run)

    return deco


@_native("allreduce")
def native_allreduce(ctx: CommContext, send: Any, recv: Any, op: Any) -> tuple:
    """``MPI_Allreduce``."""
    datatype, mpi_op = native_types(recv.dtype, op)
    sbuf = MPI.IN_PLACE if send is recv else _typed(send, datatype)
    return ctx.comm.Allreduce, (sbuf, _typed(recv, datatype), mpi_op)


@_native("reduce_scatter")
def native_reduce_scatter(ctx: CommContext, send: Any, recv: Any, op: Any) -> tuple:
    """``MPI_Reduce_scatter`` with ``array_split`` counts."""
    from .plans import rank_blocks  # noqa: PLC0415

    datatype, mpi_op = native_types(send.dtype, op)
    bounds = rank_blocks(ctx, send.size)
    counts = [bounds[i + 1] - bounds[i] for i in range(ctx.size)]
    if recv.size == 0:  # an empty view into sendbuf's memory is "aliased" for MPICH
        recv = np.empty(0, dtype=recv.dtype)
    return ctx.comm.Reduce_scatter, (_typed(send, datatype), _typed(recv, datatype), counts,
                                     mpi_op)


@_native("allgather")
def native_allgather(ctx: CommContext, send: Any, recv: Any) -> tuple:
    """``MPI_Allgather`` (as bytes)."""
    nbytes = recv.nbytes // ctx.size
    sbuf = MPI.IN_PLACE if send is None else [send, nbytes, MPI.BYTE]
    return ctx.comm.Allgather, (sbuf, [recv, nbytes, MPI.BYTE])


@_native("broadcast")
def native_broadcast(ctx: CommContext, buf: Any, root: int) -> tuple:
    """``MPI_Bcast`` (as bytes)."""
    return ctx.comm.Bcast, ([buf, buf.nbytes, MPI.BYTE], root)


@_native("reduce")
def native_reduce(ctx: CommContext, send: Any, recv: Any, op: Any, root: int) -> tuple:
    """``MPI_Reduce``."""
    datatype, mpi_op = native_types(send.dtype, op)
    if ctx.rank == root:
        sbuf = MPI.IN_PLACE if send is recv else _typed(send, datatype)
        return ctx.comm.Reduce, (sbuf, _typed(recv, datatype), mpi_op, root)
    return ctx.comm.Reduce, (_typed(send, datatype), None, mpi_op, root)
