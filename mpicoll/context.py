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

from . import config, fastpath, timeline, watchdog
from .partition import rank_ranges
from .runtime import comms, failures
from .runtime import world as runtime_world
from .topology import Topology
from .tracking import Tracker

__all__ = ["CommContext", "get_context", "resolve_comm", "world", "set_world"]

_keyval: int | None = None
_lock = threading.Lock()
# Fast lookup by handle (Get_attr costs ~0.5 us a call); entries leave when MPI deletes the
# attribute (the communicator is freed), so a later communicator reusing the handle misses.
_by_handle: dict[int, "CommContext"] = {}


def _delete_context(comm: MPI.Comm, keyval: int, ctx: "CommContext") -> None:
    fastpath.invalidate()  # cached calls are bound to this context
    _drop(ctx)


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
        self.p2p = comms.dup(self.comm, "context")  # a plain Intracomm, never an mpicoll.Comm
        #: This rank's record of its collectives here (:mod:`mpicoll.tracking`).
        self.tracker = Tracker(_comm_name(comm))
        #: The stall inspector's view of this communicator (``None``: not watched).
        self.watched = watchdog.watch(self.comm, self.tracker)
        #: Largest message of segmented algorithms, in bytes (``MPICOLL_SEGMENT_BYTES``).
        self.segment_bytes = config.segment_bytes()
        self._plans: dict[Any, Any] = {}
        self._resources: dict[Any, Any] = {}
        self._topology: Any = None
        #: Set when the context was dropped (its world was replaced, or a peer failed).
        self.abandoned = False
        #: MPI's own collectives here start their non-blocking forms, waited for through
        #: :func:`mpicoll.waiting.wait` (set by a client whose operations run on a lane
        #: with a timeout, before its first call: :mod:`mpicoll.algorithms.native`).
        self.nonblocking = False
        #: Ranks on each node when every node has as many, else those of the largest node
        #: (the layout spans nodes: auto's rules and a tuning table's node boundary must
        #: know it): what ``algorithm="auto"`` looks up. The layout is computed here,
        #: where every rank is (creating a context is collective), never later inside one
        #: rank's call.
        self.ranks_per_node = 1
        if self.size > 1:
            self.ranks_per_node = max(self.topology.node_sizes)

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

    def free(self) -> None:
        """Release the private communicators (called when the user's comm is freed).
        Communicators of a world that failed are only forgotten by the runtime
        (:func:`mpicoll.runtime.comms.free`): a collective free would wait for the dead."""
        self._plans.clear()
        rec = comms.record_of(self.p2p)
        if rec is not None and not rec.revoked and not runtime_world.failed(rec.world):
            for obj in self._resources.values():
                if hasattr(obj, "free"):
                    obj.free()
        self._resources.clear()
        if self._topology is not None:
            self._topology.free()
            self._topology = None
        watchdog.unwatch(self.watched)
        self.watched = None
        comms.free(self.p2p)


def _comm_name(comm: MPI.Comm) -> str:
    """How reports and the timeline name ``comm``: its MPI name, else its ranks in the
    current world (``"world ranks 0,2,4-7"``: :func:`mpicoll.runtime.world.world_ranks`)."""
    try:
        name = comm.Get_name()
        if name:
            return name
        world = runtime_world.world_ranks(comm)
    except MPI.Exception:
        return f"communicator {comm.handle:#x}"
    return "world ranks " + rank_ranges(world)


@atexit.register
def _free_all_at_exit() -> None:
    """Free every context before mpi4py finalizes MPI.

    mpi4py calls ``MPI_Finalize`` after the interpreter's own shutdown, when no attribute
    delete callback runs any more, so contexts would still hold their MPI objects then; a
    shared-memory window (``shm`` all-reduce) left open makes ``MPI_Finalize`` fail over
    MPICH's ofi netmod ("OFI call fabricclose failed ... Device or resource busy").
    Registered after ``mpi4py.MPI`` is imported, so it runs before mpi4py's own handler.
    Under ULFM the runtime's exit handler, which runs after this one, then finalizes
    MPI within a bound (:mod:`mpicoll.runtime.exit`).
    """
    if MPI.Is_finalized():
        return
    watchdog.announce_exit()  # before the communicators it talks on are freed
    contexts = list(_by_handle.values())
    _by_handle.clear()
    fastpath.invalidate()
    for ctx in contexts:
        if failures.peer_failed(ctx.comm):   # freeing would wait for the dead peers
            failures.fail_world(ctx.comm, failures.failed_ranks(ctx.comm, 0.0))
            ctx.abandoned = True
        ctx.free()


def world() -> MPI.Intracomm:
    """The communicator that ``comm=None`` means everywhere in mpicoll: the runtime's
    current world (:func:`mpicoll.runtime.world.comm`)."""
    return runtime_world.comm()


def set_world(comm: MPI.Intracomm | None) -> None:
    """Reconfigure to ``comm`` (``None``: ``MPI.COMM_WORLD`` again): the runtime's next
    world generation (:func:`mpicoll.runtime.world.reconfigure`). The contexts of the old
    world's communicators are dropped (their communicators freed, or only forgotten when
    the old world failed), and so are the runtime's communicators of the old world.

    Local: every rank of ``comm`` calls it at the same point (:mod:`mpicoll.elastic`).

    Raises:
        TypeError: not an mpi4py intracommunicator.
    """
    if comm is not None:
        comm = resolve_comm(comm)
    old = runtime_world.generation()
    for ctx in [c for c in _by_handle.values() if comms.record_of(c.p2p) is None
                or comms.record_of(c.p2p).world == old]:
        _drop(ctx)
    runtime_world.reconfigure(comm)
    comms.release_world(old)
    fastpath.invalidate()


def _drop(ctx: CommContext) -> None:
    """Forget ``ctx`` (its communicator freed, or its world replaced) and free it."""
    if _by_handle.get(ctx.handle) is ctx:
        del _by_handle[ctx.handle]
    ctx.abandoned = True
    ctx.free()


def resolve_comm(comm: Any, argname: str = "comm") -> MPI.Comm:
    """Return the mpi4py intracommunicator for ``comm`` (``None`` means :func:`world`:
    ``COMM_WORLD`` unless :mod:`mpicoll.elastic` shrank it).

    Raises:
        TypeError: not an mpi4py intracommunicator.
        ValueError: ``MPI.COMM_NULL``.
    """
    if comm is None:
        return runtime_world.comm()
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
            try:
                timeline.start(path)
            except ValueError as exc:
                raise ValueError(f"MPICOLL_TIMELINE: {exc}") from None


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

