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

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..algorithms.adasum import check_adasum_size
from .engine import handles
from .compression.allreduce import codec_allreduce
from .compression.compressors import CodecCompressor, Compression
from .engine.dtypes import dtype_name
from .engine.handles import GroupFuture
from .mpi_ops import (allreduce_meta, check_rows, gathered_rows, reducescatter_meta,
                      request_name, resolve_scatter_op, scatter_gradient, synchronize)
from .engine.negotiation import Meta
from .ops import Adasum, Average, ReduceOp, resolve_reduce_op
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


def _submit_group(kind: str, tensors: list[torch.Tensor], name: str | None,
                  process_set: Any, describe: Callable[[torch.Tensor, str], Meta],
                  output: Callable[[torch.Tensor], Any] = lambda t: None,
                  returns: Any = None, check: Callable[[], None] = lambda: None) -> int:
    """Submit ``tensors`` as one group request named ``name`` (or the next unnamed
    ``kind``, numbered per process set); return its handle (``returns``: what
    ``synchronize`` gives for it, else the members' results).

    Member ``i`` is named ``<group>.<i>`` and described (validated) by
    ``describe(tensor, member_name)``; ``output(tensor)`` is where its result goes
    (``None``: a new tensor made by the engine). ``check()``, after the members are
    validated, raises what the whole request cannot do in the process set's scope.
    """
    with scoped(process_set):
        base = request_name(kind, name)
        metas = [describe(t, f"{base}.{i}") for i, t in enumerate(tensors)]
        check()
        futures = engine().submit_group(Meta(base, "group", members=tuple(metas)),
                                        [(t.detach(), output(t)) for t in tensors])
    return handles.register(GroupFuture(futures), returns)


# ------------------------------------------------------------------ all-reduce
def _grouped_allreduce_async(tensors: Any, in_place: bool, average: Any, name: str | None,
                             op: Any, prescale_factor: float, postscale_factor: float,
                             process_set: Any) -> int:
    tensors = _tensor_list(tensors)
    resolved = resolve_reduce_op(average, op, adasum=True)
    return _submit_group(
        "grouped_allreduce", tensors, name, process_set,
        lambda t, member: allreduce_meta(t, member, resolved, prescale_factor,
                                         postscale_factor),
        (lambda t: t.detach()) if in_place
        else (lambda t: torch.empty_like(t, memory_format=torch.contiguous_format)),
        returns=tensors if in_place else None,
        check=lambda: check_adasum_size(engine().size) if resolved == Adasum else None)


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
    return _grouped_allreduce_async(tensors, False, average, name, op, prescale_factor,
                                    postscale_factor, process_set)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Any = None,
                             name: str | None = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = None) -> int:
    """As :func:`grouped_allreduce_async`, writing each result into its tensor."""
    return _grouped_allreduce_async(tensors, True, average, name, op, prescale_factor,
                                    postscale_factor, process_set)


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
        ctx.scaling = {"op": op, "prescale_factor": prescale, "postscale_factor": postscale}
        return tuple(synchronize(grouped_allreduce_async(list(tensors), name=name,
                                                         **ctx.scaling)))

    @staticmethod
    @backward_in_scope
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        reduced = synchronize(grouped_allreduce_async([g.contiguous() for g in grads],
                                                      **ctx.scaling))
        return (None, None, None, None, *reduced)


# ------------------------------------------------------------------ all-gather
def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: Any = None) -> int:
    """Start an all-gather (along dimension 0) of every tensor of ``tensors`` as one group;
    return a handle whose :func:`synchronize` gives the list of gathered tensors.

    Raises:
        TypeError, ValueError: bad arguments (this rank, before anything is sent).
    """
    def describe(tensor: Any, member: str) -> Meta:
        check_rows(tensor, "allgather")
        return Meta(member, "allgather", dtype_name(tensor.dtype), tuple(tensor.shape))

    return _submit_group("grouped_allgather", _tensor_list(tensors), name, process_set,
                         describe)


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
        return (None, *(gathered_rows(grad, dims, ctx.rank)
                        for grad, dims in zip(averaged, ctx.dims)))


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
    return _submit_group("grouped_reducescatter", tensors, name, process_set,
                         lambda t, member: reducescatter_meta(t, member, resolved,
                                                              prescale_factor,
                                                              postscale_factor))


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
        ctx.scaling = {"op": op, "prescale_factor": prescale, "postscale_factor": postscale}
        return tuple(synchronize(grouped_reducescatter_async(list(tensors), name=name,
                                                             **ctx.scaling)))

    @staticmethod
    @backward_in_scope
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        gathered = synchronize(grouped_allgather_async(
            [scatter_gradient(grad, **ctx.scaling) for grad in grads]))
        return (None, None, None, None, *gathered)
