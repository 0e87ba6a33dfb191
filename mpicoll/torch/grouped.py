"""Grouped collectives with Horovod's names: ``grouped_allreduce`` (also ``_async``, in place
``grouped_allreduce_`` and ``grouped_allreduce_async_``), ``grouped_allgather``
(``_async``) and ``grouped_reducescatter`` (``_async``).

A group is one request to the engine (kind ``"group"``, its members' metadata inside), so
it is negotiated as one unit: it completes, or fails with the same error, as a whole on
every rank, in one round; its members then run with that round's other requests
(all-reduces and reduce-scatters of one dtype, op and scaling fuse, within the fusion
threshold). Member ``i`` of a group named ``g`` is named ``g.i``. A handle's
:func:`~mpicoll.torch.synchronize` returns the list of results.

The non-async functions are differentiable with Horovod's gradients: a grouped all-reduce
of the incoming gradients (same op and scaling); for all-gather, the gradients averaged
over ranks, this rank's rows of each; for reduce-scatter, each gradient times ``size()``
for Sum, times both scaling factors, all-gathered as a group.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .engine import handles
from .compression.allreduce import codec_allreduce
from .compression.compressors import CodecCompressor, Compression
from .engine.dtypes import dtype_name
from .engine.handles import GroupFuture
from .mpi_ops import (allreduce_meta, check_gather, reducescatter_meta,
                      request_name, resolve_scatter_op, synchronize)
from .engine.negotiation import Meta
from .ops import Average, ReduceOp, Sum, resolve_reduce_op
from .process_sets import backward_in_scope, forward_in_scope, scoped
from .state import engine

__all__ = ["grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
           "grouped_allreduce_async_", "grouped_allgather", "grouped_allgather_async",
           "grouped_reducescatter", "grouped_reducescatter_async"]


def _tensor_list(tensors: Any) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"tensors must be a list or tuple of tensors, not "
                        f"{type(tensors).__name__}")
    if not tensors:
        raise ValueError("a grouped operation needs at least one tensor")
    return list(tensors)


def _member_names(kind: str, name: str | None, count: int,
                  process_set: Any) -> tuple[str, list[str]]:
    with scoped(process_set):  # unnamed groups are numbered per process set
        base = request_name(kind, name)
    return base, [f"{base}.{i}" for i in range(count)]


def _submit_group(base: str, metas: list[Meta], tensors: Sequence[Any],
                  outputs: Sequence[Any]) -> int:
    group = Meta(base, "group", members=tuple(metas))
    futures = engine().submit_group(group, list(zip(tensors, outputs)))
    return handles.register(GroupFuture(futures))


# ------------------------------------------------------------------ all-reduce
def _grouped_allreduce_async(tensors: Any, outputs: Any, average: Any, name: str | None,
                             op: Any, prescale_factor: float, postscale_factor: float,
                             process_set: Any) -> int:
    tensors = _tensor_list(tensors)
    resolved = resolve_reduce_op(average, op, adasum=True)
    base, names = _member_names("grouped_allreduce", name, len(tensors), process_set)
    metas = [allreduce_meta(t, n, resolved, prescale_factor, postscale_factor)
             for t, n in zip(tensors, names)]
    if outputs is None:
        outputs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    with scoped(process_set):
        return _submit_group(base, metas, [t.detach() for t in tensors], outputs)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Any = None,
                            name: str | None = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: Any = None) -> int:
    """Start an all-reduce of every tensor of ``tensors`` as one group; return a handle
    whose :func:`synchronize` gives the list of reduced tensors (new tensors).

    Args: as for :func:`~mpicoll.torch.allreduce_async`, with a list of tensors (each
        with its own shape and dtype, the same on every rank at the same position).
    Raises:
        TypeError, ValueError: bad arguments (this rank, before anything is sent).
    """
    return _grouped_allreduce_async(tensors, None, average, name, op, prescale_factor,
                                    postscale_factor, process_set)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Any = None,
                             name: str | None = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = None) -> int:
    """As :func:`grouped_allreduce_async`, writing each result into its tensor."""
    tensors = _tensor_list(tensors)
    return _grouped_allreduce_async(tensors, [t.detach() if isinstance(t, torch.Tensor)
                                              else t for t in tensors],
                                    average, name, op, prescale_factor, postscale_factor,
                                    process_set)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Any = None,
                       name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: Any = None) -> list[torch.Tensor]:
    """All-reduce every tensor of ``tensors`` in place, as one group; return them."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Any = None,
                      name: str | None = None, compression: Any = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = None,
                      feedback: Any = None) -> list[torch.Tensor]:
    """All-reduce every tensor of ``tensors`` as one group (differentiable); return the
    list of reduced tensors.

    ``compression`` and ``feedback`` as for :func:`~mpicoll.torch.allreduce`: with a codec
    compressor the group agrees once, then each member is reduced by its own compressed
    all-reduce (member ``i``'s residual key in ``feedback``: ``(name, i)``).

    Raises:
        TypeError, ValueError: bad arguments. mpicoll.MismatchError: ranks disagree on the
            number of tensors or on any member (raised on every rank, for the whole group).
    """
    tensors = _tensor_list(tensors)
    if isinstance(compression, CodecCompressor):
        with scoped(process_set):
            return list(codec_allreduce(tensors, request_name("grouped_allreduce", name),
                                        [(name, i) for i in range(len(tensors))],
                                        compression, average, op, prescale_factor,
                                        postscale_factor, feedback))
    if feedback is not None:
        raise TypeError("feedback= needs a codec compressor (Compression.int8, ...)")
    resolved = resolve_reduce_op(average, op, adasum=True)
    pairs = [compression.compress(t) for t in tensors]
    with scoped(process_set):
        reduced = GroupedAllreduceFn.apply(request_name("grouped_allreduce", name), resolved,
                                           float(prescale_factor), float(postscale_factor),
                                           *[p[0] for p in pairs])
    return [compression.decompress(t, ctx) for t, (_, ctx) in zip(reduced, pairs)]


class GroupedAllreduceFn(torch.autograd.Function):
    """Differentiable grouped all-reduce: the gradients are the same grouped all-reduce of
    the incoming gradients."""

    @staticmethod
    @forward_in_scope
    def forward(ctx: Any, name: str, op: ReduceOp, prescale: float, postscale: float,
                *tensors: torch.Tensor) -> tuple:
        ctx.op, ctx.prescale, ctx.postscale = op, prescale, postscale
        return tuple(synchronize(grouped_allreduce_async(
            list(tensors), name=name, op=op, prescale_factor=prescale,
            postscale_factor=postscale)))

    @staticmethod
    @backward_in_scope
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        reduced = synchronize(grouped_allreduce_async(
            [g.contiguous() for g in grads], op=ctx.op, prescale_factor=ctx.prescale,
            postscale_factor=ctx.postscale))
        return (None, None, None, None, *reduced)


# ------------------------------------------------------------------ all-gather
def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: Any = None) -> int:
    """Start an all-gather (along dimension 0) of every tensor of ``tensors`` as one group;
    return a handle whose :func:`synchronize` gives the list of gathered tensors.

    Raises:
        TypeError, ValueError: bad arguments (this rank, before anything is sent).
    """
    tensors = _tensor_list(tensors)
    base, names = _member_names("grouped_allgather", name, len(tensors), process_set)
    metas = []
    for tensor, member in zip(tensors, names):
        check_gather(tensor)
        metas.append(Meta(member, "allgather", dtype_name(tensor.dtype), tuple(tensor.shape)))
    with scoped(process_set):
        return _submit_group(base, metas, [t.detach() for t in tensors],
                             [None] * len(tensors))


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: Any = None) -> list[torch.Tensor]:
    """All-gather every tensor of ``tensors`` as one group (differentiable); return the
    list of gathered tensors.

    Raises:
        TypeError, ValueError: bad arguments. mpicoll.MismatchError: ranks disagree on the
            number of tensors, a dtype or the dimensions after the first (every rank).
    """
    tensors = _tensor_list(tensors)
    with scoped(process_set):
        return list(GroupedAllgatherFn.apply(request_name("grouped_allgather", name),
                                             *tensors))


class GroupedAllgatherFn(torch.autograd.Function):
    """Differentiable grouped all-gather: the incoming gradients are averaged over ranks
    (one grouped all-reduce) and each tensor keeps the rows this rank contributed."""

    @staticmethod
    @forward_in_scope
    def forward(ctx: Any, name: str, *tensors: torch.Tensor) -> tuple:
        handle = grouped_allgather_async(list(tensors), name=name)
        future = handles.lookup(handle)
        results = synchronize(handle)
        ctx.dims = [list(dims) for dims in future.extra]   # each member's per-rank rows
        ctx.rank = engine().rank
        return tuple(results)

    @staticmethod
    @backward_in_scope
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        averaged = synchronize(grouped_allreduce_async([g.contiguous() for g in grads],
                                                       op=Average))
        out = []
        for grad, dims in zip(averaged, ctx.dims):
            start = sum(dims[:ctx.rank])
            out.append(grad[start:start + dims[ctx.rank]].clone())
        return (None, *out)


# -------------------------------------------------------------- reduce-scatter
def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: Any = Average, process_set: Any = None,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """Start a reduce-scatter of every tensor of ``tensors`` as one group; return a handle
    whose :func:`synchronize` gives the list of this rank's blocks. Members with the same
    dtype fuse into one ``mpicoll.reduce_scatter``.

    Args: as for :func:`~mpicoll.torch.reducescatter_async`, with a list of tensors.
    Raises:
        TypeError, ValueError: bad arguments (this rank, before anything is sent).
    """
    tensors = _tensor_list(tensors)
    resolved = resolve_scatter_op(op)
    base, names = _member_names("grouped_reducescatter", name, len(tensors), process_set)
    metas = [reducescatter_meta(t, n, resolved, prescale_factor, postscale_factor)
             for t, n in zip(tensors, names)]
    with scoped(process_set):
        return _submit_group(base, metas, [t.detach() for t in tensors],
                             [None] * len(tensors))


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: Any = Compression.none, op: Any = Average,
                          process_set: Any = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reduce-scatter every tensor of ``tensors`` as one group (differentiable); return
    this rank's blocks.

    Raises:
        TypeError, ValueError: bad arguments. mpicoll.MismatchError: ranks disagree
            (every rank, for the whole group).
    """
    tensors = _tensor_list(tensors)
    resolved = resolve_scatter_op(op)
    pairs = [compression.compress(t) for t in tensors]
    with scoped(process_set):
        reduced = GroupedReducescatterFn.apply(request_name("grouped_reducescatter", name),
                                               resolved, float(prescale_factor),
                                               float(postscale_factor),
                                               *[p[0] for p in pairs])
    return [compression.decompress(t, ctx) for t, (_, ctx) in zip(reduced, pairs)]


class GroupedReducescatterFn(torch.autograd.Function):
    """Differentiable grouped reduce-scatter with Horovod's gradient: each incoming
    gradient times ``size()`` for Sum, times both scaling factors, all-gathered as a
    group."""

    @staticmethod
    @forward_in_scope
    def forward(ctx: Any, name: str, op: ReduceOp, prescale: float, postscale: float,
                *tensors: torch.Tensor) -> tuple:
        ctx.op, ctx.prescale, ctx.postscale = op, prescale, postscale
        return tuple(synchronize(grouped_reducescatter_async(
            list(tensors), name=name, op=op, prescale_factor=prescale,
            postscale_factor=postscale)))

    @staticmethod
    @backward_in_scope
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        scaled = []
        for grad in grads:                   # Horovod's order: size, prescale, postscale
            if int(ctx.op) == int(Sum):
                grad = grad * engine().size
            if ctx.prescale != 1.0:
                grad = grad * ctx.prescale
            if ctx.postscale != 1.0:
                grad = grad * ctx.postscale
            scaled.append(grad.contiguous())
        gathered = synchronize(grouped_allgather_async(scaled))
        return (None, None, None, None, *gathered)
