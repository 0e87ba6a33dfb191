"""Sparse all-reduce (Horovod's ``sparse_allreduce_async``) and the sparse gradients of
:class:`~mpicoll.torch.DistributedOptimizer`.

A sparse COO tensor is reduced as Horovod 0.28 reduces it: this rank's tensor is
coalesced, its indices (transposed to one row per nonzero) and its values are all-gathered
with :func:`~mpicoll.torch.allgather_async` (ranks may hold different numbers of nonzeros,
none included), and the result is the sparse tensor of every rank's indices and values:
duplicate indices are summed when it is coalesced, and ``Average`` divides the values by
the size of the process set. The result is returned coalesced, the same on every rank.

One row more than Horovod sends: the indices all-gather carries a last row per rank with
the tensor's sparse sizes, so ranks passing tensors of different sizes raise
:class:`mpicoll.MismatchError` on every rank (the dense sizes and the dtype are checked by
the all-gathers themselves).

:class:`SparseGradients` is the optimizer's side: it finds which parameters get sparse
gradients (a one-shot hook on each parameter sees the first incoming gradient, before it is
accumulated into the parameter's view of a flat buffer), takes those parameters out of the
flat buffers and submits their gradients through :func:`sparse_allreduce_async`.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from . import mpi_ops
from .engine import handles
from ..errors import MismatchError
from .engine.dtypes import check_supported
from .ops import Average, ReduceOp, Sum, check_op_dtype, resolve_reduce_op
from .process_sets import scoped
from .state import engine

__all__ = ["SparseHandle", "sparse_allreduce_async", "SparseGradients"]


class SparseHandle:
    """The handle of :func:`sparse_allreduce_async`.

    Call it (as Horovod's, a function) or pass it to ``hvd.synchronize`` to get the
    reduced tensor; ``hvd.poll`` says whether that will block. Like an integer handle it
    can be synchronized once.
    """

    __slots__ = ("_indices", "_values", "_name", "_op", "_divisor", "_done")

    def __init__(self, indices: int, values: int, name: str, op: ReduceOp, divisor: int) -> None:
        self._indices, self._values = indices, values
        self._name, self._op, self._divisor = name, op, divisor
        self._done = False

    def poll(self) -> bool:
        """Whether both all-gathers have finished.

        Raises:
            ValueError: already synchronized.
        """
        self._check_pending()
        return mpi_ops.poll(self._indices) and mpi_ops.poll(self._values)

    def synchronize(self) -> torch.Tensor:
        """Wait for both all-gathers; return the reduced sparse tensor (coalesced).

        Raises:
            ValueError: already synchronized.
            mpicoll.MismatchError: ranks passed tensors of different sizes, dtypes or
                numbers of sparse dimensions (on every rank).
            mpicoll.CollectiveError: an all-gather failed (a rank has joined, ...).
        """
        self._check_pending()
        self._done = True
        dims_future = handles.lookup(self._indices)
        try:
            values = mpi_ops.synchronize(self._values)   # values first, as Horovod
        except BaseException:
            with contextlib.suppress(Exception):         # release it; the first error counts
                mpi_ops.synchronize(self._indices)
            raise
        indices = mpi_ops.synchronize(self._indices)
        rows = [int(d) for d in dims_future.extra]       # per rank: nonzeros + 1 size row
        ends = torch.tensor(rows, dtype=torch.long).cumsum(0) - 1
        sizes = indices[ends]
        if not bool((sizes == sizes[0]).all()):
            seen: dict[tuple, list[int]] = {}
            for rank, row in enumerate(sizes.tolist()):
                seen.setdefault(tuple(row) + tuple(values.shape[1:]), []).append(rank)
            details = [f"ranks {ranks} have {list(size)}" for size, ranks in seen.items()]
            raise MismatchError(f"sparse_allreduce {self._name!r}: ranks disagree on the "
                                f"size: " + "; ".join(details), details)
        keep = torch.ones(indices.shape[0], dtype=torch.bool)
        keep[ends] = False
        size = tuple(int(s) for s in sizes[0].tolist()) + tuple(values.shape[1:])
        result = torch.sparse_coo_tensor(indices[keep].t(), values, size,
                                         check_invariants=False).coalesce()
        if int(self._op) == int(Average) and self._divisor != 1:
            reduced = result.values()
            floating = reduced.dtype.is_floating_point or reduced.dtype.is_complex
            # integers as the adapter's Average: toward zero
            reduced.div_(self._divisor, rounding_mode=None if floating else "trunc")
        return result

    __call__ = synchronize

    def _check_pending(self) -> None:
        if self._done:
            raise ValueError(f"sparse_allreduce {self._name!r} was already synchronized")


def _check_sparse(tensor: Any) -> None:
    """Raise ``TypeError`` unless ``tensor`` is a sparse COO CPU tensor of a supported
    dtype with at least one sparse dimension."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"sparse_allreduce_async needs a torch.Tensor, not "
                        f"{type(tensor).__name__}")
    if tensor.layout is not torch.sparse_coo:
        raise TypeError(f"sparse_allreduce_async needs a sparse COO tensor (layout "
                        f"torch.sparse_coo), not one of layout {tensor.layout}; use "
                        f"allreduce for dense tensors")
    if tensor.sparse_dim() < 1:
        raise TypeError("sparse_allreduce_async needs a tensor with at least one sparse "
                        "dimension")
    check_supported(tensor._values(), "tensor's values")


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None,
                           op: Any = Average, process_set: Any = None) -> SparseHandle:
    """Start the reduction of a sparse COO tensor over the ranks; return its handle.

    As Horovod: an all-gather of the (coalesced) indices and one of the values, named
    ``<name>.indices`` and ``<name>.values``; the handle builds the sparse result.

    Args:
        tensor: a sparse COO CPU tensor (``layout=torch.sparse_coo``), any supported dtype;
            same size on every rank, any number of nonzeros (none included).
        name: matches this request across ranks (default: an ordered counter,
            ``sparse_allreduce.noname.<n>``).
        op: ``Average`` (default; values divided by the process set's size, integers
            toward zero) or ``Sum``, as Horovod supports for sparse tensors.
        process_set: a registered :class:`~mpicoll.torch.ProcessSet` (only its ranks
            call this); default every rank.
    Returns:
        A :class:`SparseHandle`: ``handle()`` or ``hvd.synchronize(handle)`` returns the
        reduced tensor, coalesced, identical on every rank.
    Raises:
        TypeError: not a sparse COO CPU tensor, or an unsupported dtype (this rank,
            before anything is sent).
        ValueError: an op other than Average/Sum, a bad name, a process set this rank is
            not in (this rank, before anything is sent).
    """
    _check_sparse(tensor)
    resolved = resolve_reduce_op(None, op, adasum=True)
    if int(resolved) not in (int(Average), int(Sum)):
        raise ValueError(f"sparse_allreduce_async supports op=Average or op=Sum, not "
                         f"{resolved!r}")
    check_op_dtype(resolved, tensor.dtype, 1.0, 1.0)
    with scoped(process_set):
        base = mpi_ops.request_name("sparse_allreduce", name)
        divisor = engine().size
        coalesced = tensor.detach().coalesce()
        sizes = torch.tensor([list(coalesced.shape[:coalesced.sparse_dim()])],
                             dtype=torch.long)
        rows = torch.cat([coalesced.indices().t(), sizes]).contiguous()
        values = coalesced.values().contiguous()
        indices_handle = mpi_ops.allgather_async(rows, name=f"{base}.indices")
        values_handle = mpi_ops.allgather_async(values, name=f"{base}.values")
    return SparseHandle(indices_handle, values_handle, base, resolved, divisor)


class SparseGradients:
    """The parameters of a :class:`~mpicoll.torch.DistributedOptimizer` whose gradients
    are sparse, and their reduction.

    Each parameter with a view in the flat gradient buffers gets a hook that sees its
    first incoming gradient before accumulation. A sparse one marks the parameter sparse:
    it leaves ``views`` (the optimizer's mapping, changed in place), its ``.grad`` stops
    being the dense view (so autograd stores the sparse gradient), and
    :meth:`step_done` tells the optimizer to rebuild its flat buffers without it. Every
    rank must see the same parameters' first gradients (the same model).

    With ``densify=True`` (``sparse_as_dense=True``) a parameter found sparse keeps its
    view: its gradients accumulate into it and are reduced as dense tensors, and the
    optimizer hands the reduced gradient back as a sparse tensor (:attr:`sparse` says
    which parameters and their numbers of sparse dimensions).

    Args:
        params: the optimizer's parameters. views: parameter -> its view of a flat buffer.
        names: parameter -> its name (requests are named ``sparse_allreduce.<name>``).
        process_set: the optimizer's process set.
        densify: only record which parameters are sparse (``sparse_as_dense=True``).
    """

    def __init__(self, params: list, views: dict, names: dict, process_set: Any,
                 densify: bool = False) -> None:
        self.densify = densify
        self._views = views
        self._names = names
        self._process_set = process_set
        #: parameter -> its number of sparse dimensions.
        self.sparse: dict[torch.Tensor, int] = {}
        self._seen: set[torch.Tensor] = set()
        self._changed = False
        self._probes = {p: p.register_hook(self._probe(p)) for p in params if p in views}

    def _probe(self, p: torch.Tensor) -> Any:
        def hook(grad: torch.Tensor) -> None:
            if p in self._seen:
                return
            self._seen.add(p)
            if grad.is_sparse:
                self._mark(p, grad.sparse_dim())
        return hook

    def _mark(self, p: torch.Tensor, sparse_dim: int) -> None:
        """Make ``p`` a sparse parameter (during backward, before its first accumulation)."""
        self.sparse[p] = sparse_dim
        if self.densify:
            return
        view = self._views.pop(p, None)
        if view is not None and p.grad is view:
            p.grad = view.to_sparse(sparse_dim) if bool(view.any()) else None
            view.zero_()
        self._changed = True

    def routes(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s gradient goes through :meth:`submit`."""
        return not self.densify and (p in self.sparse or
                                     (p.grad is not None and p.grad.is_sparse))

    def submit(self, p: torch.Tensor, op: ReduceOp) -> SparseHandle:
        """Start the reduction of ``p``'s sparse gradient (an empty one if it has none)."""
        grad = p.grad
        if grad is None:
            sparse_dim = self.sparse[p]
            grad = p.grad = torch.sparse_coo_tensor(
                torch.empty((sparse_dim, 0), dtype=torch.long),
                torch.empty((0, *p.shape[sparse_dim:]), dtype=p.dtype), p.shape,
                check_invariants=False)
        else:
            self.sparse.setdefault(p, grad.sparse_dim())
        return sparse_allreduce_async(grad, name=f"sparse_allreduce.{self._names[p]}", op=op,
                                      process_set=self._process_set)

    def step_done(self) -> bool:
        """After a synchronize: drop the hooks that have seen a gradient; return whether
        parameters became sparse since the last call (the flat buffers must be rebuilt)."""
        for p in [p for p in self._probes if p in self._seen]:
            self._probes.pop(p).remove()
        changed, self._changed = self._changed, False
        return changed
