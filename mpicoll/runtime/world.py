"""The world: the communicator ``comm=None`` means, and its one failure state machine.

The job starts with world generation 0, ``MPI.COMM_WORLD``. Each world goes through

    healthy -> failed(ranks) -> reconfigured

:func:`mark_failed` (called by :mod:`mpicoll.runtime.failures` when MPI reports a process
failure) moves the current world to *failed*; :func:`reconfigure` (an elastic shrink or
growth) makes a new communicator the next generation's world and marks the old one
*reconfigured*. Clients that cache anything made for a world (contexts, engines, process
groups, averagers) compare :func:`generation` with the one they built for, and rebuild on
a change: the world is learnt from here, never through callbacks.
"""
from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import Any

from mpi4py import MPI

__all__ = ["State", "World", "current", "comm", "generation", "world_of", "failed",
           "mark_failed", "reconfigure", "world_ranks", "most_ranks"]


class State(enum.Enum):
    """Where a world is in its life."""

    HEALTHY = "healthy"
    FAILED = "failed"
    RECONFIGURED = "reconfigured"


@dataclass
class World:
    """One world generation.

    Attributes:
        generation: 0 for ``MPI.COMM_WORLD``, then one more per reconfiguration.
        comm: the world's communicator (``None``: ``MPI.COMM_WORLD``).
        state: healthy, failed or reconfigured.
        failed_ranks: the ranks of ``comm`` known to have failed (while failed).
        failed_at_exit: the failure was first noticed after the program's main thread had
            ended (in an exit handler): the program never heard of it.
        members: the group of ``comm``, taken when it became the world (``None``: MPI
            was not initialized then): what its ranks were once it is freed.
        size: the communicator's size (kept: at exit the communicator may be freed).
    """

    generation: int
    comm: Any = None
    state: State = State.HEALTHY
    failed_ranks: list[int] = field(default_factory=list)
    failed_at_exit: bool = False
    members: Any = None
    size: int = 0

    @property
    def communicator(self) -> MPI.Intracomm:
        """The world's communicator (``MPI.COMM_WORLD`` for generation 0)."""
        return MPI.COMM_WORLD if self.comm is None else self.comm

    @property
    def group(self) -> MPI.Group:
        """The world's processes, also after its communicator was freed (a later
        reconfiguration frees a healthy world's)."""
        return MPI.COMM_WORLD.Get_group() if self.members is None else self.members


_lock = threading.Lock()
_worlds: list[World] = [
    World(0, members=MPI.COMM_WORLD.Get_group(), size=MPI.COMM_WORLD.Get_size())
    if MPI.Is_initialized() else World(0)]
#: The current world's communicator (read on every ``comm=None`` call: kept at hand).
_comm: MPI.Intracomm = MPI.COMM_WORLD
#: handle -> generation of every world communicator after the first
_handles: dict[int, int] = {}


def current() -> World:
    """The current world."""
    return _worlds[-1]


def comm() -> MPI.Intracomm:
    """The current world's communicator: what ``comm=None`` means everywhere in mpicoll."""
    return _comm


def generation() -> int:
    """The current world's generation (one more after each reconfiguration)."""
    return len(_worlds) - 1


def world_of(comm: Any) -> int:
    """The generation ``comm`` belongs to: a world communicator's own, else the current
    (a communicator the user made is taken to belong to the world of its time)."""
    handle = getattr(comm, "handle", None)
    if handle == MPI.COMM_WORLD.handle:
        return 0
    return _handles.get(handle, generation())


def world_ranks(comm: MPI.Comm, ranks: list[int] | None = None,
                gen: int | None = None) -> list[int]:
    """The ranks in world generation ``gen`` (default: the current world, :func:`comm`)
    of ``comm``'s ranks ``ranks`` (default: all), in order (``MPI.UNDEFINED`` for a
    process outside it): how reports and the timeline name the ranks of any communicator,
    and which ranks of a world failed. Not ``MPI.COMM_WORLD``'s: a process that joined a
    growth has a ``COMM_WORLD`` of its own (its spawn's), and after a shrink or a growth
    the program's ranks are the current world's.

    Raises:
        MPI.Exception: ``comm`` cannot be queried (freed, failed).
    """
    world = _worlds[-1 if gen is None else gen]
    mine, target = comm.Get_group(), world.group
    try:
        return list(MPI.Group.Translate_ranks(
            mine, list(range(mine.Get_size())) if ranks is None else ranks, target))
    finally:
        mine.Free()
        if target is not world.members:
            target.Free()


def most_ranks() -> int:
    """The largest size of the worlds this process has been in (read at exit too, when
    the world's communicator may be freed)."""
    return max(w.size for w in _worlds)


def state_world(gen: int) -> World:
    """World generation ``gen``."""
    return _worlds[gen]


def failed(gen: int) -> bool:
    """Whether world generation ``gen`` has failed (or was replaced after a failure)."""
    w = _worlds[gen]
    return w.state is State.FAILED or bool(w.failed_ranks)


def mark_failed(gen: int, ranks: list[int]) -> bool:
    """Record that ranks of world ``gen`` failed (healthy -> failed). Returns whether the
    world was healthy before (the first report)."""
    with _lock:
        w = _worlds[gen]
        first = w.state is State.HEALTHY
        if first:
            w.failed_at_exit = not threading.main_thread().is_alive()
        if w.state is not State.RECONFIGURED:
            w.state = State.FAILED
        w.failed_ranks = sorted(set(w.failed_ranks) | set(ranks))
        return first


def reconfigure(new: MPI.Intracomm | None) -> World:
    """Make ``new`` the world (``None``: ``MPI.COMM_WORLD`` again, as a new generation).

    Local: every rank of ``new`` calls it at the same point (:mod:`mpicoll.elastic` does,
    after a shrink or a growth). The previous world becomes *reconfigured*; the runtime's
    communicators of it are released by the caller (:func:`mpicoll.runtime.comms.release_world`).
    """
    global _comm
    with _lock:
        old = _worlds[-1]
        old.state = State.RECONFIGURED
        w = World(len(_worlds), None if new is None or new == MPI.COMM_WORLD else new)
        w.members, w.size = w.communicator.Get_group(), w.communicator.Get_size()
        _worlds.append(w)
        if w.comm is not None:
            _handles[w.comm.handle] = w.generation
        _comm = w.communicator
        return w
