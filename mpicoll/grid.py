"""A 2-D process grid for hybrid parallelism: data-parallel axis x tensor-parallel axis.

``dp * tp`` ranks are laid out row by row, Megatron-style: rank ``r`` sits at
``(dp_rank, tp_rank) = divmod(r, tp)``. A *tensor-parallel group* (a row) is ``tp``
consecutive ranks, which share a node when ranks are placed by node; a *data-parallel
group* (a column) holds the ranks with the same ``tp_rank``, one from every row::

    dp=2, tp=3     tensor-parallel groups (rows): [0, 1, 2], [3, 4, 5]
                   data-parallel groups (columns): [0, 3], [1, 4], [2, 5]

:func:`process_grid` builds this rank's row and column communicators on any
communicator, collectively. :func:`agreed_shape` (the shape checked on every rank) and
:func:`grid_groups` (every group's ranks) are what ``mpicoll.torch.process_grid`` builds
its process sets from.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from mpi4py import MPI

from .context import resolve_comm
from .runtime import comms

__all__ = ["ProcessGrid", "process_grid", "agreed_shape", "grid_groups", "grid_coords"]

log = logging.getLogger("mpicoll.grid")


def agreed_shape(comm: MPI.Intracomm, dp: int, tp: int) -> tuple[int, int]:
    """Check, collectively, that every rank of ``comm`` asks for the same valid grid.

    Args:
        comm: the communicator the grid covers (every rank calls this).
        dp, tp: the number of rows (data-parallel degree) and columns (tensor-parallel
            degree) this rank asks for.
    Returns:
        ``(dp, tp)``.
    Raises:
        ValueError: on every rank, with the same message, when ranks disagree, a degree is
            not a positive int, or ``dp * tp`` differs from ``comm``'s size.
    """
    shapes = comm.allgather((dp, tp))
    if any(shape != shapes[0] for shape in shapes):
        differ = "; ".join(f"rank {r} has dp x tp = {d} x {t}"
                           for r, (d, t) in enumerate(shapes))
        raise ValueError(f"process grid: ranks disagree on the grid shape: {differ}")
    for label, value in (("dp", dp), ("tp", tp)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(  # noqa: TRY004  (one error type for every bad grid, as documented)
                f"process grid: {label} must be an int, not {type(value).__name__}")
        if value < 1:
            raise ValueError(f"process grid: {label} must be at least 1, not {value}")
    size = comm.Get_size()
    if dp * tp != size:
        raise ValueError(f"process grid: dp x tp = {dp} x {tp} = {dp * tp} does not equal the "
                         f"number of ranks ({size}); choose dp and tp whose product is {size}")
    return dp, tp


def grid_coords(rank: int, tp: int) -> tuple[int, int]:
    """``(dp_rank, tp_rank)`` of ``rank`` in a grid with ``tp`` columns."""
    return divmod(rank, tp)


def grid_groups(dp: int, tp: int) -> tuple[list[list[int]], list[list[int]]]:
    """Every group of a ``dp x tp`` grid, as ranks of the grid's communicator.

    Returns:
        ``(tensor_parallel, data_parallel)``: the ``dp`` rows (``tp`` consecutive ranks
        each), then the ``tp`` columns (``dp`` ranks each, stride ``tp``), both in order.
    """
    rows = [[d * tp + t for t in range(tp)] for d in range(dp)]
    cols = [[d * tp + t for d in range(dp)] for t in range(tp)]
    return rows, cols


@dataclass
class ProcessGrid:
    """This rank's place in a ``dp x tp`` grid and its two axis communicators.

    Attributes:
        dp, tp: the data-parallel degree (rows) and the tensor-parallel degree (columns).
        dp_rank, tp_rank: this rank's row and column; ``dp_rank`` is also its rank in
            ``dp_comm`` and ``tp_rank`` its rank in ``tp_comm``.
        tp_comm: this rank's row (its tensor-parallel group, ``tp`` ranks).
        dp_comm: this rank's column (its data-parallel group, ``dp`` ranks).
    """

    dp: int
    tp: int
    dp_rank: int
    tp_rank: int
    tp_comm: MPI.Intracomm
    dp_comm: MPI.Intracomm

    def free(self) -> None:
        """Free both communicators (collective over each)."""
        for comm in (self.tp_comm, self.dp_comm):
            if comm != MPI.COMM_NULL:
                comm.Free()


def process_grid(comm: MPI.Intracomm | None, dp: int, tp: int) -> ProcessGrid:
    """Split ``comm`` into a ``dp x tp`` grid (collective over ``comm``).

    Under :mod:`mpicoll.elastic`, build the grid from ``comm=None`` inside the elastic
    function (or a reset callback): after a failure the world is the survivors', and the
    old grid's communicators, which hold a dead rank, are dropped without :meth:`free`.

    Args:
        comm: an mpi4py intracommunicator (or :class:`mpicoll.Comm`) of ``dp * tp`` ranks;
            ``None``: the current world (:func:`mpicoll.context.world`).
        dp, tp: the data-parallel and tensor-parallel degrees, the same on every rank.
    Returns:
        This rank's :class:`ProcessGrid`; its communicators work with every
        ``mpicoll`` collective (``mpicoll.allreduce(x, comm=grid.tp_comm)``).
    Raises:
        ValueError: on every rank, as :func:`agreed_shape`.
    """
    comm = resolve_comm(comm)
    agreed_shape(comm, dp, tp)
    rank = comm.Get_rank()
    dp_rank, tp_rank = grid_coords(rank, tp)
    tp_comm = comms.split(comm, dp_rank, tp_rank, "grid")
    dp_comm = comms.split(comm, tp_rank, dp_rank, "grid")
    log.debug("rank %d: process grid %d x %d at (%d, %d)", rank, dp, tp, dp_rank, tp_rank)
    return ProcessGrid(dp, tp, dp_rank, tp_rank, tp_comm, dp_comm)
