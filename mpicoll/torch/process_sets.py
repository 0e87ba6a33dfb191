"""Horovod's process sets: collectives among a subset of the ranks.

``ps = hvd.add_process_set([0, 2])`` (on every rank) or ``hvd.init(process_sets=[...])``
registers a set: every rank of the adapter's communicator takes part (same sets, same
order), the ranks of the set get their own :class:`~mpicoll.torch.engine.core.Engine` on a
communicator split from it by the runtime (:func:`mpicoll.runtime.comms.split`, owner
``"process_set"``; the engine runs on it and frees it), and ``process_set=ps`` on a collective submits it to that
engine. Ranks are always *global* ranks (``hvd.rank()``), as in Horovod: ``root_rank`` of a
broadcast too; ``ps.rank()`` is the rank within the set (the order of an all-gather's
result). ``hvd.global_process_set`` (id 0) is the whole communicator.

:func:`process_grid` registers the process sets of a data-parallel x tensor-parallel grid
(:mod:`mpicoll.grid`'s layout) in one call.

An operation's engine is found through :func:`scoped` (a context variable that
:func:`mpicoll.torch.state.engine` reads), so the collectives and their autograd
functions need no engine argument.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from mpi4py import MPI

from ..elastic import grow
from ..grid import agreed_shape, grid_coords, grid_groups
from ..runtime import comms
from .engine.core import Engine
from .engine.dtypes import dtype_name
from .engine.negotiation import Meta

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
           "register_all", "check_usable", "outside", "scoped", "scoped_engine",
           "current_engine", "attach", "detach", "forward_in_scope", "backward_in_scope",
           "ProcessSetGrid", "process_grid", "global_rank"]

#: The engine of the process set an operation is running in (``None``: the global one).
_current: contextvars.ContextVar[Engine | None] = contextvars.ContextVar(
    "mpicoll_torch_process_set", default=None)

_lock = threading.Lock()
#: The global engine and the communicator given to ``init`` (set by :func:`attach`).
_world: tuple[Engine, MPI.Intracomm] | None = None
#: id -> (its ProcessSet, this rank's engine for it or None when not included).
_registry: dict[int, tuple[ProcessSet, Engine | None]] = {}
#: The id of the next set registered: from 1 again after each :func:`detach` (Horovod's
#: table starts afresh at each ``init``), so that every rank numbers the sets alike, a
#: process that joined a growth too (the running ranks' sets were dropped at the reset).
_next_id = 1


class ProcessSet:
    """A set of global ranks that run collectives together (Horovod's class).

    Args:
        ranks_or_comm: global ranks (any order, unique). An mpi4py communicator is not
            supported: pass its ranks.
    Attributes:
        ranks: the sorted ranks. process_set_id: set when registered (``None`` before and
            after removal or shutdown).
    """

    def __init__(self, ranks_or_comm: Sequence[int] | Any) -> None:
        if isinstance(ranks_or_comm, MPI.Comm):
            raise NotImplementedError("a process set from an mpi4py communicator is not "
                                      "supported; pass its global ranks")
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise ValueError("ProcessSet should be initialized with a list of process "
                             "ranks") from None
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError(f"ProcessSet ranks must be ints, not {ranks!r}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet ranks must be unique: {ranks}")
        self.ranks: list[int] | None = ranks
        self.process_set_id: int | None = None

    def size(self) -> int | None:
        """Number of ranks in the set (``None`` if not registered; the global
        communicator's for the global set)."""
        if self.process_set_id is None:
            return None
        if self.process_set_id == 0:
            return _world_or_raise()[0].size
        return len(_registered(self)[0].ranks or ())

    def rank(self) -> int | None:
        """This process's rank within the set (``None`` if not registered).

        Raises:
            ValueError: this process is not in the set.
        """
        if self.process_set_id is None:
            return None
        if self.process_set_id == 0:
            return _world_or_raise()[0].rank
        engine = _registered(self)[1]
        if engine is None:
            raise ValueError("Process is not part of provided process set.")
        return engine.rank

    def included(self) -> bool | None:
        """Whether this process is in the set (``None`` if not registered)."""
        if self.process_set_id is None or self.ranks is None:
            return None
        return _world_or_raise()[0].rank in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def _registered(process_set: ProcessSet) -> tuple[ProcessSet, Engine | None]:
    entry = _registry.get(process_set.process_set_id)   # type: ignore[arg-type]
    if entry is None:
        raise ValueError("Process set does not exist or has not been registered.")
    return entry


def attach(engine: Engine, comm: MPI.Intracomm) -> None:
    """Called by ``init``: the global engine, and the communicator sets are split from."""
    global _world
    _world = (engine, comm)
    global_process_set.ranks = list(range(engine.size))


def _world_or_raise() -> tuple[Engine, MPI.Intracomm]:
    if _world is None:
        raise ValueError("mpicoll.torch has not been initialized; use hvd.init().")
    return _world


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set; collective over every rank of the adapter (same sets in the
    same order everywhere).

    Returns:
        The registered set (``process_set`` itself, or a new one from a list of ranks).
    Raises:
        ValueError: ranks out of range, empty, already registered, or different across
            ranks (on every rank).
        RuntimeError: in a process that joined a running job, made before
            ``dist.init_process_group('mpicoll')`` where the running ranks have one.
    """
    global _next_id
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    world, comm = _world_or_raise()
    dist = sys.modules.get("torch.distributed")
    grow.check_made_in_order("add_process_set", {grow.DIST_INIT: bool(
        dist is not None and dist.is_initialized() and dist.get_backend() == "mpicoll")})
    ranks = tuple(process_set.ranks or ())
    every = _gather_through_engine("add_process_set", ranks)
    error = _registration_error(every, world.size)
    if error:
        raise ValueError(error)
    me = comm.Get_rank()
    color = 0 if me in ranks else MPI.UNDEFINED
    sub = comms.split(comm, color, me, "process_set")
    engine = None
    if sub != MPI.COMM_NULL:
        engine = Engine(sub, world.settings, private=True)
        engine.members = list(ranks)
        engine.start()
    with _lock:
        process_set.process_set_id = _next_id
        _registry[_next_id] = (process_set, engine)
        _next_id += 1
    return process_set


def _gather_through_engine(tag: str, values: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every rank's ``values``, all-gathered by the global engine (negotiated like any
    request, named ``__<tag>__``): a rank waiting here counts as blocked, so when another
    rank is blocked in some other operation (ranks that took different paths) both fail
    at once with the negotiation's deadlock error instead of hanging in a bare MPI call.

    Raises:
        mpicoll.CollectiveError: the gather can never complete (or the engine stopped).
    """
    world = _world_or_raise()[0]
    mine = torch.tensor(values, dtype=torch.int64)
    future = world.submit(Meta(f"__{tag}__", "allgather", dtype_name(mine.dtype),
                               tuple(mine.shape)), mine, None, waiting=True)
    world.wait(future)
    if future.error is not None:
        raise future.error
    parts = torch.split(future.result, [int(count) for count in future.extra])
    return [tuple(part.tolist()) for part in parts]


def _registration_error(every: list[tuple[int, ...]], size: int) -> str:
    """Why the ranks every process passed (``every``) cannot be registered, or ""."""
    ranks = every[0]
    if any(r != ranks for r in every):
        differ = sorted({r for r in every}, key=len)
        return f"add_process_set: ranks disagree on the process set: {differ}"
    if not ranks:
        return "add_process_set: a process set needs at least one rank"
    if ranks[0] < 0 or ranks[-1] >= size:
        return f"add_process_set: ranks {list(ranks)} out of range for {size} ranks"
    if ranks == tuple(range(size)) or any(tuple(ps.ranks or ()) == ranks
                                         for ps, _ in _registry.values()):
        return f"Attempted to add a duplicate process set: {list(ranks)}"
    return ""


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` (collective, like :func:`add_process_set`); stop its
    engine. Returns whether it was removed (never the global set).

    Raises:
        ValueError: on every rank, when ranks name different sets.
    """
    if process_set.process_set_id in (None, 0):
        return False
    # every rank removes it, after its last operation (raises unless initialized)
    every = _gather_through_engine("remove_process_set", (process_set.process_set_id,))
    if len(set(every)) != 1:  # (each rank removed its own: the registries diverged)
        raise ValueError(f"remove_process_set: ranks disagree on the process set: ids "
                         f"{[i for (i,) in every]} by rank")
    with _lock:
        entry = _registry.pop(process_set.process_set_id, None)  # type: ignore[arg-type]
    process_set.process_set_id = None
    if entry is None:
        return False
    if entry[1] is not None:
        entry[1].shutdown("it removed the process set")
    return True


def register_all(process_sets: Sequence[ProcessSet] | None) -> None:
    """Register ``init(process_sets=...)``'s sets, in order; a set equal to an earlier one
    (or to the global set) is left unregistered, as Horovod does. ``"dynamic"``
    (Horovod's way to allow sets added later): none (sets may always be added here)."""
    if process_sets == "dynamic":
        return
    for process_set in process_sets or ():
        if not isinstance(process_set, ProcessSet):
            raise TypeError(f"process_sets must hold ProcessSet objects, not "
                            f"{type(process_set).__name__}")
        try:
            add_process_set(process_set)
        except ValueError as exc:
            if "duplicate" not in str(exc):
                raise
            process_set.process_set_id = None


def detach(reason: str, stop: str = "shutdown") -> None:
    """At ``shutdown`` (this rank's or another's): forget the sets (and the global engine)
    and stop every process-set engine of this rank with its method ``stop``; ``reason``
    says why, for the other ranks' errors.

    ``stop="abandon"``: after a process failure (:mod:`mpicoll.torch.elastic`), stop them
    without a shutdown round (:meth:`Engine.abandon`: some members may be dead); the
    global set follows the next ``init``. The next set registered gets id 1 again.
    """
    global _world, _next_id
    with _lock:
        entries = list(_registry.values())
        _registry.clear()
        _world = None
        _next_id = 1
    for process_set, _ in entries:
        process_set.process_set_id = None
    for _, engine in entries:
        if engine is not None:
            getattr(engine, stop)(reason)


def check_usable(process_set: ProcessSet | None) -> Engine | None:
    """Raise unless this rank may run operations on ``process_set``; return the engine its
    operations go to (``None``: the global one).

    Raises:
        ValueError: not registered, or this rank is not in it.
        TypeError: not a ProcessSet.
    """
    if process_set is None or process_set is global_process_set:
        return None
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ProcessSet, not {type(process_set).__name__}")
    if process_set.process_set_id == 0:
        return None
    engine = _registered(process_set)[1]
    if engine is None:
        raise ValueError(f"this rank is not in {process_set!r}: only its ranks may run "
                         f"operations on it")
    return engine


def outside(process_set: ProcessSet | None) -> bool:
    """Whether ``process_set`` is a registered set that this rank is not in."""
    return (isinstance(process_set, ProcessSet) and process_set.process_set_id is not None
            and process_set.process_set_id != 0 and not process_set.included())


def current_engine() -> Engine | None:
    """The engine of the process set in scope (``None``: the global one)."""
    return _current.get()


@contextlib.contextmanager
def scoped_engine(engine: Engine | None) -> Iterator[None]:
    """Run the block with ``engine`` as the engine of its operations."""
    token = _current.set(engine)
    try:
        yield
    finally:
        _current.reset(token)


def scoped(process_set: ProcessSet | None) -> contextlib.AbstractContextManager:
    """Run the block's operations in ``process_set``; ``None`` or the global set leave
    the scope as it is (the global engine, or the set of the operation whose autograd
    function is running).

    Raises:
        ValueError, TypeError: as :func:`check_usable`.
    """
    engine = check_usable(process_set)
    return contextlib.nullcontext() if engine is None else scoped_engine(engine)


def forward_in_scope(forward: Callable) -> Callable:
    """Decorate an autograd ``forward``: remember the engine in scope for ``backward``."""
    @functools.wraps(forward)
    def wrapper(ctx: Any, *args: Any) -> Any:
        ctx.scope_engine = _current.get()
        return forward(ctx, *args)
    return wrapper


def backward_in_scope(backward: Callable) -> Callable:
    """Decorate an autograd ``backward``: run it in the scope its ``forward`` ran in."""
    @functools.wraps(backward)
    def wrapper(ctx: Any, *grads: Any) -> Any:
        with scoped_engine(getattr(ctx, "scope_engine", None)):
            return backward(ctx, *grads)
    return wrapper


def global_rank(set_rank: int) -> int:
    """The global rank of ``set_rank`` in the engine in scope (itself for the global one)."""
    running = current_engine()
    if running is None or running.members is None:
        return set_rank
    return running.members[set_rank]


@dataclass
class ProcessSetGrid:
    """The process sets of a ``dp x tp`` grid (see :func:`process_grid`).

    Attributes:
        dp, tp: the data-parallel degree (rows) and the tensor-parallel degree (columns).
        dp_rank, tp_rank: this rank's row and column (its rank in ``data_parallel`` and in
            ``tensor_parallel``).
        tensor_parallel: this rank's row (``tp`` consecutive global ranks).
        data_parallel: this rank's column (``dp`` ranks, stride ``tp``).
        tensor_parallel_sets, data_parallel_sets: every row and every column, in order.
    """

    dp: int
    tp: int
    dp_rank: int
    tp_rank: int
    tensor_parallel: ProcessSet
    data_parallel: ProcessSet
    tensor_parallel_sets: list[ProcessSet]
    data_parallel_sets: list[ProcessSet]
    #: The sets this grid registered (not the global set, nor sets registered before).
    registered: list[ProcessSet] = field(default_factory=list)

    def remove(self) -> None:
        """Unregister the sets this grid registered (collective, like
        :func:`remove_process_set`)."""
        for process_set in self.registered:
            remove_process_set(process_set)
        self.registered = []


def process_grid(dp: int, tp: int) -> ProcessSetGrid:
    """Register the process sets of a ``dp x tp`` grid of the adapter's ranks; collective
    over every rank (the same sets in the same order everywhere: every row, then every
    column).

    Rank ``r`` sits at ``(dp_rank, tp_rank) = divmod(r, tp)`` (:mod:`mpicoll.grid`): a row
    of ``tp`` consecutive ranks is a tensor-parallel group, a column a data-parallel group.
    A group of every rank is :data:`global_process_set`; a group already registered is
    reused (and left registered by :meth:`ProcessSetGrid.remove`).

    Args:
        dp, tp: the data-parallel and tensor-parallel degrees, ``dp * tp == hvd.size()``.
    Returns:
        This rank's :class:`ProcessSetGrid`.
    Raises:
        ValueError: on every rank, with the same message: ranks disagree, a degree is not a
            positive int, or ``dp * tp`` is not the number of ranks.
    """
    world, comm = _world_or_raise()
    agreed_shape(comm, dp, tp)
    rows, cols = grid_groups(dp, tp)
    registered: list[ProcessSet] = []

    def register(ranks: list[int]) -> ProcessSet:
        if len(ranks) == world.size:
            return global_process_set
        with _lock:
            existing = next((ps for ps, _ in _registry.values() if ps.ranks == ranks), None)
        if existing is None:
            registered.append(existing := add_process_set(ranks))
        return existing

    row_sets = [register(ranks) for ranks in rows]
    col_sets = [register(ranks) for ranks in cols]
    dp_rank, tp_rank = grid_coords(world.rank, tp)
    return ProcessSetGrid(dp, tp, dp_rank, tp_rank, row_sets[dp_rank], col_sets[tp_rank],
                          row_sets, col_sets, registered)
