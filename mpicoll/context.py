"""Per-communicator state, cached on the communicator itself.

Each user communicator gets one :class:`CommContext`, stored as an MPI attribute (so it
lives exactly as long as the communicator and cannot be confused with a later communicator
that reuses the handle). It holds a private duplicate of the communicator for mpicoll's
point-to-point traffic, so our messages can never match the user's own sends and receives,
and a cache of plans (neighbours, chunk bounds, scratch buffers) keyed by
(algorithm, count, dtype, ...).
"""
from __future__ import annotations

import atexit
import threading
from typing import Any, Callable

from mpi4py import MPI

from . import config, fastpath, faults, timeline, watchdog
from .topology import Topology
from .tracking import Tracker

__all__ = ["CommContext", "get_context", "resolve_comm", "world", "set_world", "abandon"]

_keyval: int | None = None
_lock = threading.Lock()
# Fast lookup by handle (Get_attr costs ~0.5 us a call); entries leave when MPI deletes the
# attribute (the communicator is freed), so a later communicator reusing the handle misses.
_by_handle: dict[int, "CommContext"] = {}
#: The communicator ``comm=None`` means (``None``: ``MPI.COMM_WORLD``); see :func:`set_world`.
_world: MPI.Intracomm | None = None


def _delete_context(comm: MPI.Comm, keyval: int, ctx: "CommContext") -> None:
    if _by_handle.get(ctx.handle) is ctx:
        del _by_handle[ctx.handle]
    fastpath.invalidate()  # cached calls are bound to this context
    ctx.free()


def _get_keyval() -> int:
    global _keyval
    with _lock:
        if _keyval is None:
            _keyval = MPI.Comm.Create_keyval(delete_fn=_delete_context)
        return _keyval


class CommContext:
    """mpicoll's state for one communicator.

    Attributes:
        comm: the user's communicator (native collectives run on it).
        p2p: private duplicate used for all of mpicoll's point-to-point messages.
        rank, size: this rank and the number of ranks.
    """

    #: Largest number of cached plans per communicator (oldest evicted first).
    MAX_PLANS = 256

    def __init__(self, comm: MPI.Comm) -> None:
        # A plain mpi4py view of the handle: native collectives must call MPI's own
        # methods even when the caller passed an mpicoll.Comm (which overrides them).
        self.comm = comm if type(comm) is MPI.Intracomm else MPI.Intracomm(comm)
        self.handle = comm.handle
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.p2p = self.comm.Dup()  # a plain Intracomm: never an mpicoll.Comm (checked)
        #: This rank's record of its collectives here (:mod:`mpicoll.tracking`).
        self.tracker = Tracker(_comm_name(comm))
        #: The stall inspector's view of this communicator (``None``: not watched).
        self.watched = watchdog.watch(self.comm, self.tracker)
        #: Largest message of segmented algorithms, in bytes (``MPICOLL_SEGMENT_BYTES``).
        self.segment_bytes = config.segment_bytes()
        self._plans: dict[Any, Any] = {}
        self._resources: dict[Any, Any] = {}
        self._topology: Any = None
        #: Set by :func:`abandon`: the communicators may have dead peers, so nothing is
        #: freed (a collective free would wait for them); the MPI objects are leaked.
        self.abandoned = False
        #: Ranks on each node when every node has as many, else 0 (unknown): what
        #: ``algorithm="auto"`` looks up. The layout is computed here, where every rank is
        #: (creating a context is collective), never later inside one rank's call.
        self.ranks_per_node = 1
        if self.size > 1:
            topo = self.topology
            self.ranks_per_node = topo.local_size if topo.uniform else 0

    def plan(self, key: Any, build: Callable[[], Any]) -> Any:
        """Return the cached plan for ``key``, building it with ``build()`` the first time."""
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= self.MAX_PLANS:
                self._plans.pop(next(iter(self._plans)))
            plan = self._plans[key] = build()
        return plan

    def resource(self, key: Any, build: Callable[[], Any]) -> Any:
        """Return the object kept under ``key``, building it with ``build()`` the first time.

        For objects that ranks create collectively (a shared-memory window): unlike plans
        they are never evicted, since a rank re-creating one alone would wait forever for
        the others. Objects with a ``free()`` method are freed with the context.
        """
        obj = self._resources.get(key)
        if obj is None:
            obj = self._resources[key] = build()
        return obj

    @property
    def topology(self) -> Any:
        """The node layout of this communicator (collective on first use)."""
        if self._topology is None:
            self._topology = Topology(self.comm)
        return self._topology

    def communicators(self) -> list[Any]:
        """Every communicator this context holds or uses: the user's, the private
        duplicate, the node layout's node and leader communicators (once built), the
        resources' (shared-memory windows' ``comm``) and the stall inspector's duplicate.
        Some may be ``None`` or ``MPI.COMM_NULL``."""
        held = [self.comm, self.p2p]
        if self._topology is not None:
            held += [self._topology.node_comm, self._topology.cross_comm]
        held += [getattr(obj, "comm", None) for obj in list(self._resources.values())]
        if self.watched is not None:
            held.append(getattr(self.watched, "comm", None))
        return held

    def free(self) -> None:
        """Release the private communicators (called when the user's comm is freed);
        an abandoned context only drops its references."""
        self._plans.clear()
        if self.abandoned:
            self._resources.clear()
            self._topology = None
            watchdog.unwatch(self.watched, free=False)
            self.watched = None
            return
        for obj in self._resources.values():
            if hasattr(obj, "free"):
                obj.free()
        self._resources.clear()
        if self._topology is not None:
            self._topology.free()
            self._topology = None
        watchdog.unwatch(self.watched)
        self.watched = None
        if self.p2p != MPI.COMM_NULL and not MPI.Is_finalized():
            self.p2p.Free()


def _comm_name(comm: MPI.Comm) -> str:
    """How reports and the timeline name ``comm``: its MPI name, else its world ranks
    (``"world ranks 0,2,4-7"``)."""
    try:
        name = comm.Get_name()
        if name:
            return name
        world = MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())),
                                          MPI.COMM_WORLD.Get_group())
    except MPI.Exception:
        return f"communicator {comm.handle:#x}"
    spans: list[str] = []
    for rank in world:
        if spans and rank == _span_end(spans[-1]) + 1:
            spans[-1] = f"{spans[-1].split('-')[0]}-{rank}"
        else:
            spans.append(str(rank))
    return "world ranks " + ",".join(spans)


def _span_end(span: str) -> int:
    return int(span.rsplit("-", 1)[-1])


@atexit.register
def _free_all_at_exit() -> None:
    """Free every context before mpi4py finalizes MPI.

    mpi4py calls ``MPI_Finalize`` after the interpreter's own shutdown, when no attribute
    delete callback runs any more, so contexts would still hold their MPI objects then; a
    shared-memory window (``shm`` all-reduce) left open makes ``MPI_Finalize`` fail over
    MPICH's ofi netmod ("OFI call fabricclose failed ... Device or resource busy").
    Registered after ``mpi4py.MPI`` is imported, so it runs before mpi4py's own handler.
    After a process failure (ULFM) it ends the process without ``MPI_Finalize``
    (:func:`mpicoll.faults.exit_without_finalize`).
    """
    if MPI.Is_finalized():
        return
    watchdog.announce_exit()  # before the communicators it talks on are freed
    contexts = list(_by_handle.values())
    _by_handle.clear()
    fastpath.invalidate()
    for ctx in contexts:
        if _has_failed_peers(ctx.comm):
            ctx.abandoned = True              # freeing would wait for the dead peers
        ctx.free()
    if faults.failure_seen:
        faults.exit_without_finalize()        # MPI_Finalize may wait for the dead


def _has_failed_peers(comm: MPI.Comm) -> bool:
    """Whether ULFM reports a failed process in ``comm`` (never, without ULFM on)."""
    return faults.ENABLED and bool(faults.failed_ranks(comm, 0.0))


def world() -> MPI.Intracomm:
    """The communicator that ``comm=None`` means everywhere in mpicoll: ``MPI.COMM_WORLD``
    unless :func:`set_world` replaced it (:mod:`mpicoll.elastic` does, with the
    survivors' communicator after a failure)."""
    return MPI.COMM_WORLD if _world is None else _world


def set_world(comm: MPI.Intracomm | None) -> None:
    """Make ``comm`` what ``comm=None`` means (``None``: ``MPI.COMM_WORLD`` again).

    Local: every rank of ``comm`` should call it at the same point. Cached calls made with
    ``comm=None`` are dropped (they are bound to the previous world's context).

    Raises:
        TypeError: not an mpi4py intracommunicator.
    """
    global _world
    if comm is not None:
        comm = resolve_comm(comm)
    _world = None if comm is None or comm == MPI.COMM_WORLD else comm
    fastpath.invalidate()


def abandon(comm: MPI.Comm) -> None:
    """Forget the contexts of ``comm`` and of every communicator they hold, without
    freeing any MPI object (a communicator with a dead peer cannot be freed collectively;
    the survivors go on with a new one). A later :func:`get_context` of the same
    communicator builds a fresh context. Revoke first (:func:`mpicoll.faults.revoke_all`)
    so that no survivor still waits on them."""
    todo, seen = [comm], set()
    while todo:
        c = todo.pop()
        if not isinstance(c, MPI.Comm) or c == MPI.COMM_NULL or c.handle in seen:
            continue
        seen.add(c.handle)
        ctx = _by_handle.pop(c.handle, None)
        if ctx is None:
            continue
        todo += ctx.communicators()
        ctx.abandoned = True
        ctx.free()
    fastpath.invalidate()


def resolve_comm(comm: Any, argname: str = "comm") -> MPI.Comm:
    """Return the mpi4py intracommunicator for ``comm`` (``None`` means :func:`world`:
    ``COMM_WORLD`` unless :mod:`mpicoll.elastic` shrank it).

    Raises:
        TypeError: not an mpi4py intracommunicator.
        ValueError: ``MPI.COMM_NULL``.
    """
    if comm is None:
        return MPI.COMM_WORLD if _world is None else _world
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"{argname} must be an mpi4py intracommunicator (or None for "
                        f"COMM_WORLD), not {type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise ValueError(f"{argname} is MPI.COMM_NULL")
    return comm


_timeline_checked = False


def _start_timeline_once() -> None:
    """``MPICOLL_TIMELINE=path``: start the timeline with the first communicator."""
    global _timeline_checked
    if not _timeline_checked:
        _timeline_checked = True
        path = config.env_str("MPICOLL_TIMELINE")
        if path and not timeline.ON:
            timeline.start(path)


def get_context(comm: MPI.Comm) -> CommContext:
    """Return (creating on first use; collective then) the context of ``comm``."""
    ctx = _by_handle.get(comm.handle)
    if ctx is not None:
        return ctx
    keyval = _get_keyval()
    _start_timeline_once()
    ctx = comm.Get_attr(keyval)
    if ctx is None or ctx.abandoned:
        ctx = CommContext(comm)
        comm.Set_attr(keyval, ctx)
    _by_handle[ctx.handle] = ctx
    return ctx


faults.bind_contexts(_by_handle.get, resolve_comm)
