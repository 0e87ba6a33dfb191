"""Tensor collectives with Horovod's names: ``allreduce``, ``allgather``, ``broadcast``
(each also ``_async``, and in place with a trailing ``_``), ``alltoall``,
``reducescatter`` (and ``_async``), ``poll``, ``synchronize``, ``barrier`` and ``join``.

Every function validates its arguments on the calling thread (raising ``TypeError`` or
``ValueError`` before anything is sent), then submits one request to the engine. Requests
are matched across ranks by name; unnamed requests are named ``<kind>.noname.<n>`` by a
per-kind counter, which matches when ranks issue unnamed operations in the same order.

The non-underscore functions support autograd, with Horovod's gradients (the
``torch.autograd.Function`` of each collective stands next to it):

- all-reduce: the gradient is the same all-reduce (op and scaling factors) of the incoming
  gradients (exact for Average and Sum; for Min/Max/Product, as in Horovod, an
  approximation);
- all-gather: the incoming gradients are averaged over ranks and each rank keeps the rows
  it contributed;
- broadcast: the incoming gradients are averaged over ranks onto the root; other ranks get
  zeros;
- all-to-all: the incoming gradient goes back by an all-to-all with the received splits;
- reduce-scatter: the incoming gradient, times ``size()`` for Sum (not for Average) and
  times both scaling factors, is all-gathered (Horovod's rule, exactly).

:func:`allreduce_meta` and :func:`submit_allreduce` are the validated building blocks that
:class:`~mpicoll.torch.DistributedOptimizer` uses for its gradient buffers.
"""
from __future__ import annotations

from typing import Any

import torch

from .engine import handles
from ..algorithms.adasum import check_adasum_size
from .compression.allreduce import codec_allreduce
from .compression.compressors import CodecCompressor, Compression
from .engine.dtypes import check_supported, dtype_name
from .engine.negotiation import JOIN, Meta
from .ops import (Adasum, Average, ReduceOp, Sum, UnsupportedOpError, check_op_dtype,
                  resolve_reduce_op)
from .process_sets import backward_in_scope, forward_in_scope, global_rank, scoped
from .state import engine

__all__ = ["allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "allgather",
           "allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
           "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
           "poll", "synchronize", "barrier", "join", "allreduce_meta", "submit_allreduce",
           "alltoall_meta", "reducescatter_meta", "request_name",
           "check_rows", "resolve_scatter_op", "SplitsTypeError", "gathered_rows",
           "scatter_gradient",
           "AllreduceFn", "AllgatherFn", "BroadcastFn", "AlltoallFn", "ReducescatterFn"]

def request_name(kind: str, name: str | None) -> str:
    """``name`` (checked to be a string), or the next ``<kind>.noname.<n>`` of the engine in
    scope (:meth:`~mpicoll.torch.engine.core.Engine.unnamed_name`): operations in a process
    set are numbered apart from the global ones, so unnamed operations that only a set's
    ranks issue do not shift the numbering of later unnamed global operations (which
    would then never match across ranks)."""
    if name is not None:
        if not isinstance(name, str):
            raise TypeError(f"name must be a string, not {type(name).__name__}")
        return name
    return engine().unnamed_name(kind)


def _submit(meta: Meta, tensor: Any = None, output: Any = None, waiting: bool = False,
            returns: Any = None) -> int:
    return handles.register(engine().submit(meta, tensor, output, waiting), returns)


def allreduce_meta(tensor: torch.Tensor, name: str | None, op: ReduceOp,
                   prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                   layout: str = "") -> Meta:
    """Validate one all-reduce and describe it for the engine.

    Args:
        tensor: what is reduced. name: ``None`` for the next unnamed all-reduce.
        op: a resolved op (:func:`~mpicoll.torch.ops.resolve_reduce_op`).
        layout: what a fused request covers (see :class:`~mpicoll.torch.engine.negotiation.Meta`).
    Returns:
        The request's metadata.
    Raises:
        TypeError, ValueError: a tensor, op or scaling the adapter cannot reduce.
    """
    check_supported(tensor)
    check_op_dtype(op, tensor.dtype, prescale_factor, postscale_factor)
    return Meta(request_name("allreduce", name), "allreduce", dtype_name(tensor.dtype),
                tuple(tensor.shape), int(op), -1, float(prescale_factor),
                float(postscale_factor), layout)


def submit_allreduce(tensor: torch.Tensor, output: torch.Tensor, name: str | None,
                     op: ReduceOp, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, layout: str = "",
                     waiting: bool = False, returns: Any = None) -> int:
    """Validate and submit one all-reduce of ``tensor`` into ``output``; return a handle.

    Args:
        waiting: the caller will :func:`synchronize` at once (see :meth:`Engine.submit`).
        returns: what :func:`synchronize` returns (default: ``output``).
        Others: as for :func:`allreduce_meta`.
    Raises:
        TypeError, ValueError: as :func:`allreduce_meta`; for ``Adasum``, a number of ranks
            (in scope) that is not a power of two
            (:class:`~mpicoll.algorithms.adasum.AdasumUnsupportedError`, also a
            ``NotImplementedError`` as in Horovod).
    """
    meta = allreduce_meta(tensor, name, op, prescale_factor, postscale_factor, layout)
    if int(op) == int(Adasum):
        check_adasum_size(engine().size)
    return _submit(meta, tensor.detach(), output, waiting, returns)


def allreduce_async(tensor: torch.Tensor, average: Any = None, name: str | None = None,
                    op: Any = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set: Any = None) -> int:
    """Start an all-reduce of ``tensor`` into a new tensor; return a handle.

    Args:
        tensor: CPU tensor (any supported dtype, any shape; same on every rank).
        average: deprecated; ``True`` means ``op=Average``, ``False`` ``op=Sum``.
        name: matches this request across ranks (default: an ordered counter).
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product`` or ``Adasum``
            (floating tensors, a power-of-two number of ranks; see
            :mod:`~mpicoll.algorithms.adasum`).
        prescale_factor, postscale_factor: multiply the input before, the result after
            (as Horovod: integer tensors in float64, cast back toward zero; float16 in
            float32).
        process_set: a registered :class:`~mpicoll.torch.ProcessSet` (only its ranks
            call this; ``Average`` divides by its size); default the global set.
    Returns:
        A handle for :func:`poll` / :func:`synchronize` (which returns the result).
    Raises:
        TypeError, ValueError: bad arguments (on this rank, before anything is sent).
    """
    output = torch.empty_like(tensor, memory_format=torch.contiguous_format) \
        if isinstance(tensor, torch.Tensor) else None     # on the tensor's device
    with scoped(process_set):
        return submit_allreduce(tensor, output, name, resolve_reduce_op(average, op, adasum=True),
                                prescale_factor, postscale_factor)


def allreduce_async_(tensor: torch.Tensor, average: Any = None, name: str | None = None,
                     op: Any = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, process_set: Any = None) -> int:
    """As :func:`allreduce_async`, writing the result into ``tensor`` (which
    :func:`synchronize` returns, as Horovod's does)."""
    in_place = isinstance(tensor, torch.Tensor)
    with scoped(process_set):
        return submit_allreduce(tensor, tensor.detach() if in_place else None, name,
                                resolve_reduce_op(average, op, adasum=True), prescale_factor,
                                postscale_factor, returns=tensor if in_place else None)


def allreduce(tensor: torch.Tensor, average: Any = None, name: str | None = None,
              compression: Any = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: Any = None, feedback: Any = None) -> torch.Tensor:
    """All-reduce ``tensor`` (differentiable); return a new tensor.

    Args:
        compression: a Horovod-style compressor (``Compression.none``,
            ``Compression.fp16``, or any compress/decompress pair), or a codec compressor
            (``Compression.bf16``, ``.int8``, ``.onebit``, ``.topk(r)``, ``.randomk(r)``,
            ``.from_codec(spec)``): float32/float64 CPU tensors, op Average or Sum,
            reduced by :func:`mpicoll.compression.allreduce` (see
            :mod:`~mpicoll.torch.compression.allreduce`; its gradient is compressed too).
        feedback: codec compressors only: an :class:`mpicoll.compression.ErrorFeedback`
            that keeps this tensor's residual under the key ``name`` (the caller keeps it
            across calls). ``None`` (default): no error feedback.
        Others: as for :func:`allreduce_async`.
    Returns:
        The reduced tensor, identical on every rank.
    Raises:
        TypeError, ValueError: bad arguments (with a codec compressor: on the rank that
            passed them, the others raise ``mpicoll.RemoteError``). mpicoll.MismatchError:
            ranks disagree on shape, dtype, op, scaling or codec (raised on every rank).
        mpicoll.CollectiveError: with a codec compressor, a rank has joined.
    """
    if isinstance(compression, CodecCompressor):
        with scoped(process_set):
            return codec_allreduce([tensor], request_name("allreduce", name), [name],
                                   compression, average, op, prescale_factor,
                                   postscale_factor, feedback)[0]
    if feedback is not None:
        raise TypeError("feedback= needs a codec compressor (Compression.int8, ...); "
                        f"{compression!r} keeps no residuals")
    op = resolve_reduce_op(average, op, adasum=True)
    compressed, ctx = compression.compress(tensor)
    with scoped(process_set):
        reduced = AllreduceFn.apply(compressed, request_name("allreduce", name), op,
                                    prescale_factor, postscale_factor)
    return compression.decompress(reduced, ctx)


def allreduce_(tensor: torch.Tensor, average: Any = None, name: str | None = None,
               op: Any = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set: Any = None) -> torch.Tensor:
    """All-reduce ``tensor`` in place; return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def check_rows(tensor: Any, kind: str) -> None:
    """Raise unless ``tensor`` is supported and has a dimension 0 for ``kind`` to split."""
    check_supported(tensor)
    if tensor.dim() == 0:
        raise ValueError(f"{kind} needs a tensor with at least one dimension")


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: Any = None) -> int:
    """Start an all-gather along dimension 0 (sizes may differ across ranks); return a handle.

    The other dimensions and the dtype must agree across ranks.
    """
    check_rows(tensor, "allgather")
    with scoped(process_set):
        meta = Meta(request_name("allgather", name), "allgather", dtype_name(tensor.dtype),
                    tuple(tensor.shape))
        return _submit(meta, tensor.detach(), None)


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: Any = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0, in rank order (differentiable).

    Raises:
        TypeError, ValueError: bad arguments. mpicoll.MismatchError: ranks disagree on the
            dtype or on the dimensions after the first.
    """
    check_rows(tensor, "allgather")
    with scoped(process_set):
        return AllgatherFn.apply(tensor, request_name("allgather", name))


def _check_root(root_rank: Any) -> int:
    """``root_rank`` (a global rank, as in Horovod) as a rank of the engine in scope."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, int):
        raise TypeError(f"root_rank must be an int, not {type(root_rank).__name__}")
    running = engine()
    if running.members is not None:
        if root_rank not in running.members:
            raise ValueError(f"root_rank={root_rank} is not in the process set "
                             f"{running.members}")
        return running.members.index(root_rank)
    n = running.size
    if not 0 <= root_rank < n:
        raise ValueError(f"root_rank={root_rank} is out of range for {n} ranks")
    return int(root_rank)


def _broadcast_async(tensor: Any, in_place: bool, root_rank: Any, name: str | None,
                     process_set: Any) -> int:
    check_supported(tensor)
    output = tensor.detach() if in_place \
        else tensor.detach().clone(memory_format=torch.contiguous_format)
    with scoped(process_set):
        root = _check_root(root_rank)
        meta = Meta(request_name("broadcast", name), "broadcast", dtype_name(tensor.dtype),
                    tuple(tensor.shape), -1, root)
        return _submit(meta, None, output, returns=tensor if in_place else None)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: Any = None) -> int:
    """Start a broadcast of ``root_rank``'s ``tensor`` into a new tensor; return a handle.

    ``root_rank`` is a global rank (``hvd.rank()``), in ``process_set`` if one is given."""
    return _broadcast_async(tensor, False, root_rank, name, process_set)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: Any = None) -> int:
    """Start a broadcast of ``root_rank``'s ``tensor`` into ``tensor`` itself."""
    return _broadcast_async(tensor, True, root_rank, name, process_set)


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: Any = None) -> torch.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank, as a new tensor (differentiable)."""
    check_supported(tensor)
    with scoped(process_set):
        _check_root(root_rank)
        return BroadcastFn.apply(tensor, root_rank, request_name("broadcast", name))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: Any = None) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s, in place; return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class SplitsTypeError(TypeError, ValueError):
    """All-to-all ``splits`` of the wrong type (floating-point or boolean values, more than
    one dimension, not a list, tuple or tensor): a ``TypeError`` and a ``ValueError``
    (Horovod's class for it), so either ``except`` catches it."""


def _alltoall_splits(splits: Any, first_dim: int, size: int) -> tuple[tuple, str]:
    """Check ``splits`` on this rank: (the splits as ints, an error message or "").

    Type problems raise here; value problems (length, negative entries, a sum larger than
    dimension 0, dimension 0 not a multiple of ``size`` without splits) become the
    request's error, raised on every rank once all have submitted.
    """
    if splits is None:
        if first_dim % size:
            return (), (f"splits not given, but the first dimension ({first_dim}) is not a "
                        f"multiple of the number of ranks ({size})")
        return (), ""
    if isinstance(splits, torch.Tensor):
        if splits.dtype.is_floating_point or splits.dtype.is_complex or \
                splits.dtype is torch.bool:
            raise SplitsTypeError(f"splits must hold integers, not {splits.dtype}")
        if splits.dim() > 1:
            raise SplitsTypeError(f"splits must be one-dimensional, not of shape "
                            f"{tuple(splits.shape)}")
        values = [int(v) for v in splits.reshape(-1).tolist()]
    elif isinstance(splits, (list, tuple)):
        if any(isinstance(v, bool) or not isinstance(v, int) for v in splits):
            raise SplitsTypeError(f"splits must be integers, not {list(splits)!r}")
        values = [int(v) for v in splits]
    else:
        raise SplitsTypeError(f"splits must be a list, tuple or integer tensor, not "
                        f"{type(splits).__name__}")
    if len(values) != size:
        return tuple(values), (f"splits has {len(values)} entries; it needs one per rank "
                               f"({size})")
    if any(v < 0 for v in values):
        return tuple(values), f"splits {values} has negative entries"
    if sum(values) > first_dim:
        return tuple(values), (f"splits {values} sum to {sum(values)}, more than the first "
                               f"dimension of the tensor ({first_dim})")
    return tuple(values), ""


def alltoall_meta(tensor: Any, splits: Any, name: str | None) -> Meta:
    """Validate one all-to-all and describe it for the engine.

    Raises:
        TypeError, ValueError: a bad tensor, or splits that are not integers (this rank).
    """
    check_rows(tensor, "alltoall")
    values, error = _alltoall_splits(splits, int(tensor.shape[0]), engine().size)
    return Meta(request_name("alltoall", name), "alltoall", dtype_name(tensor.dtype),
                tuple(tensor.shape), splits=values, error=error)


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: Any = None) -> int:
    """Start an all-to-all along dimension 0; return a handle.

    :func:`synchronize` returns ``(output, received_splits)`` (as Horovod's).

    Args:
        tensor: rows to send; every dimension after the first must agree across ranks.
        splits: rows of ``tensor`` for each rank, in rank order (a list, tuple or integer
            tensor of ``size()`` entries, summing to at most ``tensor.shape[0]``; rows past
            the sum are not sent). ``None`` splits dimension 0 evenly (it must then be a
            multiple of ``size()``).
        name: matches this request across ranks. process_set: as for
            :func:`allreduce_async` (``splits`` then has one entry per rank of the set).
    Returns:
        A handle for :func:`poll` / :func:`synchronize`.
    Raises:
        TypeError, ValueError: a bad tensor or splits type (this rank, before sending).
        Bad split values fail on every rank at :func:`synchronize`: ``ValueError`` on the
        ranks that passed them, ``mpicoll.RemoteError`` (same message) on the others.
    """
    with scoped(process_set):
        meta = alltoall_meta(tensor, splits, name)
        return _submit(meta, tensor.detach(), None)


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: Any = None) -> Any:
    """Send row block ``i`` of ``tensor`` to rank ``i``; return the blocks every rank sent
    here, concatenated in rank order (differentiable).

    Args: as for :func:`alltoall_async`.
    Returns:
        The received tensor; with ``splits`` given, ``(received, received_splits)`` where
        ``received_splits`` (``int32``, one entry per rank) says how many rows came from
        each rank (Horovod's return convention).
    Raises:
        as :func:`alltoall_async`; mpicoll.MismatchError: ranks disagree on the dtype or
        the dimensions after the first; mpicoll.CollectiveError: a rank has joined.
    """
    check_supported(tensor)
    with scoped(process_set):
        out, received = AlltoallFn.apply(tensor, splits, request_name("alltoall", name))
    return out if splits is None else (out, received)


def reducescatter_meta(tensor: Any, name: str | None, op: Any,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Meta:
    """Validate one reduce-scatter and describe it for the engine.

    Raises:
        TypeError, ValueError: a bad tensor, an op other than Average/Sum, bad scaling.
    """
    op = resolve_scatter_op(op)
    check_rows(tensor, "reducescatter")
    check_op_dtype(op, tensor.dtype, prescale_factor, postscale_factor)
    return Meta(request_name("reducescatter", name), "reducescatter", dtype_name(tensor.dtype),
                tuple(tensor.shape), int(op), -1, float(prescale_factor),
                float(postscale_factor))


def resolve_scatter_op(op: Any) -> ReduceOp:
    """``op`` of a reduce-scatter, checked on the calling rank.

    Raises:
        UnsupportedOpError: not ``Average`` or ``Sum`` (a ``ValueError`` and, as Horovod's
            error, a ``RuntimeError``).
    """
    if isinstance(op, bool) or not isinstance(op, int) or int(op) not in (int(Average),
                                                                           int(Sum)):
        raise UnsupportedOpError(f"reducescatter supports op=Average or op=Sum, not {op!r}")
    return ReduceOp(int(op))


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = Average,
                        process_set: Any = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """Start a reduce-scatter along dimension 0; return a handle.

    Every rank passes a tensor of the same shape; the reduced tensor's rows are split
    across ranks as Horovod splits them: ``rows // size()`` each, one more for the first
    ``rows % size()`` ranks.

    Args:
        op: ``Average`` (default) or ``Sum``.
        prescale_factor, postscale_factor: as for :func:`allreduce_async`.
        name, process_set: as for :func:`allreduce_async`.
    Raises:
        TypeError, ValueError: bad arguments (this rank, before sending).
    """
    with scoped(process_set):
        meta = reducescatter_meta(tensor, name, op, prescale_factor, postscale_factor)
        return _submit(meta, tensor.detach(), None)


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: Any = Compression.none, op: Any = Average,
                  process_set: Any = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over ranks and return this rank's rows of the result
    (differentiable). Arguments as for :func:`reducescatter_async`, plus ``compression``
    (as for :func:`allreduce`).

    Raises:
        TypeError, ValueError: bad arguments. mpicoll.MismatchError: ranks disagree on shape,
        dtype, op or scaling. mpicoll.CollectiveError: a rank has joined.
    """
    resolved = resolve_scatter_op(op)
    compressed, ctx = compression.compress(tensor)
    with scoped(process_set):
        reduced = ReducescatterFn.apply(compressed, request_name("reducescatter", name),
                                        resolved, float(prescale_factor),
                                        float(postscale_factor))
    return compression.decompress(reduced, ctx)


def poll(handle: int) -> bool:
    """Whether the operation of ``handle`` has finished (``synchronize`` will not block)."""
    if callable(handle):                   # a sparse_allreduce_async handle (mpicoll.torch.sparse)
        return bool(handle.poll())
    future = handles.lookup(handle)
    if not future.done():
        (future.owner or engine()).poke()
    return future.done()


def _wait(future: Any) -> None:
    """Wait for ``future`` on the engine; a future already done (failed by a shutdown of
    this rank, so without an engine now) needs none."""
    running = future.owner
    if running is None:
        try:
            running = engine()
        except ValueError:
            if future.done():
                return
            raise
    running.wait(future)


def synchronize(handle: int) -> Any:
    """Wait for the operation of ``handle``; return its result and release the handle.

    Raises:
        mpicoll.MismatchError: ranks disagreed about this operation (on every rank).
        mpicoll.CollectiveError: it can never complete, or the engine stopped.
    """
    if callable(handle):                   # a sparse_allreduce_async handle (mpicoll.torch.sparse)
        return handle()
    if handles.released(handle):           # synchronized before: None, as in Horovod
        return None
    future = handles.lookup(handle)
    result = None
    try:
        _wait(future)
    finally:
        if future.done():
            result = handles.value(handle, future) if future.error is None else None
            handles.release(handle)
    if future.error is not None:
        raise future.error
    return result


def barrier(process_set: Any = None) -> None:
    """Return once every rank (that has not joined) of ``process_set`` (default: all) has
    called ``barrier``."""
    with scoped(process_set):
        handle = _submit(Meta(request_name("barrier", None), "barrier"))
    synchronize(handle)


def join(device: int = -1, process_set: Any = None) -> int:
    """Stop taking part with data; return once every rank (of ``process_set``: default
    all) has joined.

    ``device`` is accepted for Horovod compatibility (CPU only: ignored).

    Until then this rank contributes zeros to other ranks' all-reduces (averages still
    divide by :func:`size`) and no rows to their all-gathers.

    Returns:
        The (global) rank that joined last.
    """
    with scoped(process_set):
        handle = _submit(Meta(JOIN, "join"))
        return global_rank(int(synchronize(handle)))


class AllreduceFn(torch.autograd.Function):
    """Differentiable all-reduce: the gradient is the same all-reduce of the incoming
    gradients."""

    @staticmethod
    @forward_in_scope
    def forward(ctx: Any, tensor: torch.Tensor, name: str, op: ReduceOp, prescale: float,
                postscale: float) -> torch.Tensor:
        ctx.scaling = {"op": op, "prescale_factor": prescale, "postscale_factor": postscale}
        return synchronize(allreduce_async(tensor, name=name, **ctx.scaling))

    @staticmethod
    @backward_in_scope
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        reduced = synchronize(allreduce_async(grad.contiguous(), **ctx.scaling))
        return reduced, None, None, None, None


def gathered_rows(grad: torch.Tensor, dims: list[int], rank: int) -> torch.Tensor:
    """The rows of an all-gather's (averaged) gradient ``grad`` that ``rank`` contributed
    (``dims``: every rank's first dimension)."""
    start = sum(dims[:rank])
    return grad[start:start + dims[rank]].clone()


def scatter_gradient(grad: torch.Tensor, op: ReduceOp, prescale_factor: float,
                     postscale_factor: float) -> torch.Tensor:
    """Horovod's reduce-scatter gradient before its all-gather: ``grad`` times ``size()``
    for Sum (not for Average), then times ``prescale_factor``, then ``postscale_factor``."""
    if int(op) == int(Sum):
        grad = grad * engine().size
    if prescale_factor != 1.0:
        grad = grad * prescale_factor
    if postscale_factor != 1.0:
        grad = grad * postscale_factor
    return grad.contiguous()


class AllgatherFn(torch.autograd.Function):
    """Differentiable all-gather along dimension 0: the gradient is the average over ranks
    of the incoming gradients, rows of this rank (as Horovod)."""

    @staticmethod
    @forward_in_scope
    def forward(ctx: Any, tensor: torch.Tensor, name: str) -> torch.Tensor:
        handle = allgather_async(tensor, name=name)
        future = handles.lookup(handle)
        result = synchronize(handle)
        ctx.dims = list(future.extra)          # every rank's first dimension
        ctx.rank = engine().rank
        return result

    @staticmethod
    @backward_in_scope
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        averaged = synchronize(allreduce_async(grad.contiguous(), op=Average))
        return gathered_rows(averaged, ctx.dims, ctx.rank), None


class BroadcastFn(torch.autograd.Function):
    """Differentiable broadcast: the root's gradient is the average over ranks of the
    incoming gradients, other ranks' is zero (as Horovod)."""

    @staticmethod
    @forward_in_scope
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str) -> torch.Tensor:
        ctx.root = _check_root(root_rank)           # within the engine in scope
        return synchronize(broadcast_async(tensor, root_rank, name=name))

    @staticmethod
    @backward_in_scope
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        averaged = synchronize(allreduce_async(grad.contiguous(), op=Average))
        if engine().rank != ctx.root:
            averaged.zero_()
        return averaged, None, None


class AlltoallFn(torch.autograd.Function):
    """Differentiable all-to-all: the gradient goes back by an all-to-all with the splits
    this rank received (rows this rank held but did not send get zero gradient)."""

    @staticmethod
    @forward_in_scope
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str) -> tuple:
        out, received = synchronize(alltoall_async(tensor, splits, name=name))
        ctx.received = received
        ctx.rows = tensor.shape[0]
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    @backward_in_scope
    def backward(ctx: Any, grad: torch.Tensor, _unused: Any) -> tuple:
        back, _ = synchronize(alltoall_async(grad.contiguous(), ctx.received))
        if back.shape[0] < ctx.rows:
            back = torch.cat([back, back.new_zeros((ctx.rows - back.shape[0],
                                                    *back.shape[1:]))])
        return back, None, None


class ReducescatterFn(torch.autograd.Function):
    """Differentiable reduce-scatter, with Horovod's gradient: the incoming gradient times
    ``size()`` for Sum (not for Average), times the prescale and postscale factors, then
    all-gathered."""

    @staticmethod
    @forward_in_scope
    def forward(ctx: Any, tensor: torch.Tensor, name: str, op: ReduceOp, prescale: float,
                postscale: float) -> torch.Tensor:
        ctx.scaling = {"op": op, "prescale_factor": prescale, "postscale_factor": postscale}
        return synchronize(reducescatter_async(tensor, name=name, **ctx.scaling))

    @staticmethod
    @backward_in_scope
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        gathered = synchronize(allgather_async(scatter_gradient(grad, **ctx.scaling)))
        return gathered, None, None, None, None
