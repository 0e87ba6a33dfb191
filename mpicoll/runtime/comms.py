"""The one registry of every communicator mpicoll makes.

Every communicator mpicoll creates (a private duplicate, a node or leader communicator, a
process set, a torch.distributed group, the parameter server's, a shrunk or grown world) is
made here, by one of the functions below, and recorded with its *owner* (a short name:
``"context"``, ``"topology"``, ``"ps"``, ``"group"``, ...), the *world* it belongs to (the
generation of :mod:`mpicoll.runtime.world` it descends from) and its *lifetime*:

- ``"owner"``: the owner frees it (:func:`free`) when it is done with it;
- ``"world"``: it lives as long as its world, and :func:`release_world` frees it;
- ``"job"``: a growth's intercommunicator (``MPI_Comm_spawn``'s, or the parent a joining
  process was started with), freed at the process's exit (:func:`release_all`).

No other module of mpicoll calls ``Dup``, ``Split``, ``Split_type``, ``Create_group``,
``Shrink``, ``Spawn`` or ``Merge`` (a repository test checks). On a process failure
:mod:`mpicoll.runtime.failures` revokes every communicator of the failed world
(:func:`of_world`); a communicator of a world that failed is never freed (a collective free
would wait for the dead), only forgotten. A process failure during a creation is raised as
:class:`~mpicoll.ProcessFailedError` (the translation of :mod:`mpicoll.runtime.failures`).
"""
from __future__ import annotations

import contextlib
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from mpi4py import MPI

from . import world as _world

__all__ = ["Record", "plain", "dup", "split", "split_shared", "create_group", "shrink", "spawn",
           "merge", "adopt", "free", "forget", "of_world", "alive", "record_of",
           "release_world", "release_all", "descendants", "world_of", "forget_when_freed"]


@dataclass
class Record:
    """One communicator the runtime made.

    Attributes:
        comm: the communicator (a plain ``MPI.Intracomm``/``Intercomm``).
        owner: who asked for it (``"context"``, ``"ps"``, ``"group"``, ...).
        world: the world generation it belongs to (:func:`mpicoll.runtime.world.generation`).
        lifetime: ``"owner"`` (freed by its owner), ``"world"`` (freed with its world) or
            ``"job"`` (freed at exit).
        parent: the handle of the communicator it was made from (``None``: none).
        revoked: whether :mod:`mpicoll.runtime.failures` revoked it.
    """

    comm: Any
    owner: str
    world: int
    lifetime: str = "owner"
    parent: int | None = None
    revoked: bool = False


_lock = threading.Lock()
#: handle -> record of every live communicator the runtime made.
_records: dict[int, Record] = {}
#: handle -> world generation of every communicator forgotten (never freed: MPI does not
#: reuse its handle), so that a late error on it is charged to its own world.
_forgotten: dict[int, int] = {}
#: How many events :data:`history` keeps.
HISTORY = 4096
#: The last :data:`HISTORY` records made, freed or forgotten (``"made"``/``"freed"``/
#: ``"forgotten"``), oldest first: bounded, so a job that makes groups for ever does not
#: grow; tests read it.
history: deque[tuple[Record, str]] = deque(maxlen=HISTORY)


def plain(comm: Any) -> Any:
    """A plain mpi4py view of ``comm`` (MPI's own methods even for an ``mpicoll.Comm``)."""
    if type(comm) in (MPI.Intracomm, MPI.Intercomm):
        return comm
    return MPI.Intercomm(comm) if comm.Is_inter() else MPI.Intracomm(comm)


def world_of(comm: Any) -> int:
    """The world generation of ``comm``: its record's, a forgotten one's, else
    :func:`mpicoll.runtime.world.world_of`'s."""
    handle = getattr(comm, "handle", None)
    rec = _records.get(handle)
    if rec is not None:
        return rec.world
    return _forgotten[handle] if handle in _forgotten else _world.world_of(comm)


def _register(comm: Any, owner: str, parent: Any, lifetime: str = "owner",
              world: int | None = None) -> Any:
    if comm == MPI.COMM_NULL:
        return comm
    rec = Record(comm, owner, world_of(parent) if world is None else world, lifetime,
                 parent.handle if parent is not None else None)
    with _lock:
        _records[comm.handle] = rec
        history.append((rec, "made"))
    return comm


#: The error a failed creation from ``parent`` raises for MPI's ``exc``: ``exc`` itself
#: until :mod:`mpicoll.runtime.failures` (which imports this module) puts its translation
#: here.
failure_of: Callable[[BaseException, Any], BaseException] = lambda exc, parent: exc


def _made(parent: Any, make: Callable[[], Any], owner: str, lifetime: str) -> Any:
    """``make()``, an MPI call that creates a communicator from ``parent``, recorded; its
    MPI error passes through :data:`failure_of` (a process failure is raised as
    :class:`~mpicoll.ProcessFailedError`)."""
    try:
        comm = make()
    except MPI.Exception as exc:
        error = failure_of(exc, parent)
        if error is exc:
            raise
        raise error from exc
    return _register(comm, owner, parent, lifetime)


#: Whether :func:`dup` makes its duplicates with ``MPI_Comm_split`` (set by
#: :mod:`mpicoll.runtime.failures` under ULFM: Open MPI 5.0.11's ``MPI_Comm_dup`` crashed
#: the survivors when a member died during it, where its ``MPI_Comm_split`` raises
#: ``MPI_ERR_PROC_FAILED``).
dup_by_split = False


def dup(parent: Any, owner: str, lifetime: str = "owner", info: Any = None) -> MPI.Intracomm:
    """A duplicate of ``parent`` (collective over it): the same ranks in the same order."""
    view = plain(parent)
    if info is None and dup_by_split and not view.Is_inter():
        return split(parent, 0, view.Get_rank(), owner, lifetime)
    return _made(parent, view.Dup if info is None else lambda: view.Dup(info), owner,
                 lifetime)


def split(parent: Any, color: int, key: int, owner: str,
          lifetime: str = "owner") -> MPI.Intracomm:
    """``parent.Split(color, key)`` (``MPI.UNDEFINED``: ``MPI.COMM_NULL``, not recorded)."""
    return _made(parent, lambda: plain(parent).Split(color, key), owner, lifetime)


def split_shared(parent: Any, key: int, owner: str,
                 lifetime: str = "owner") -> MPI.Intracomm:
    """The ranks of ``parent`` that share memory with this one (``COMM_TYPE_SHARED``)."""
    return _made(parent, lambda: plain(parent).Split_type(MPI.COMM_TYPE_SHARED, key=key),
                 owner, lifetime)


def create_group(parent: Any, group: MPI.Group, tag: int, owner: str,
                 lifetime: str = "owner") -> MPI.Intracomm:
    """``MPI_Comm_create_group`` over the members of ``group`` (collective over them).
    Where they are every rank of ``parent``, ``MPI_Comm_split`` makes the same
    communicator: under ULFM a member that dies meanwhile fails that call on every
    survivor, where Open MPI 5.0.11's ``MPI_Comm_create_group`` can wait for it forever."""
    view = plain(parent)
    if group.Get_size() == view.Get_size():
        return split(parent, 0, group.Get_rank(), owner, lifetime)
    return _made(parent, lambda: view.Create_group(group, tag), owner, lifetime)


def shrink(parent: Any, owner: str = "world") -> MPI.Intracomm:
    """The survivors of ``parent`` (ULFM's ``MPI_Comm_shrink``), as the next world's
    communicator (recorded for the world generation :func:`world.reconfigure` starts)."""
    new = plain(parent).Shrink()
    return _register(new, owner, None, "world", world=_world.generation() + 1)


def spawn(parent: Any, command: str, args: list[str], maxprocs: int, info: Any,
          owner: str = "world") -> MPI.Intercomm:
    """``MPI_Comm_spawn`` from rank 0 of ``parent``: the intercommunicator to the new
    processes (kept for the life of the job, freed at exit)."""
    inter = plain(parent).Spawn(command, args=args, maxprocs=maxprocs, root=0, info=info)
    return _register(inter, owner, parent, "job")


def merge(inter: Any, high: bool, owner: str = "world") -> MPI.Intracomm:
    """The intracommunicator of both sides of ``inter`` (the next world's)."""
    return _register(plain(inter).Merge(high=high), owner, None, "world",
                     world=_world.generation() + 1)


def adopt(comm: Any, owner: str, lifetime: str = "job") -> Any:
    """Record a communicator MPI made (``MPI.Comm.Get_parent()``) without creating one."""
    return _register(comm, owner, None, lifetime)


def record_of(comm: Any) -> Record | None:
    """The record of ``comm``, or ``None`` when the runtime did not make it."""
    if comm is None or not isinstance(comm, MPI.Comm) or comm == MPI.COMM_NULL:
        return None
    return _records.get(comm.handle)


def free(comm: Any) -> None:
    """Free ``comm`` (a communicator the runtime made). A communicator of a world that
    failed, or one that was revoked, is only forgotten: freeing it could wait for the dead.
    Does nothing for ``None``/``MPI.COMM_NULL``, after ``MPI_Finalize``, or twice."""
    if comm is None or not isinstance(comm, MPI.Comm) or comm == MPI.COMM_NULL:
        return
    with _lock:
        rec = _records.pop(comm.handle, None)
    if rec is None:
        return
    if rec.revoked or _world.failed(rec.world) or MPI.Is_finalized():
        history.append((rec, "forgotten"))
        _forgotten[comm.handle] = rec.world
        return
    history.append((rec, "freed"))
    with contextlib.suppress(MPI.Exception):   # revoked meanwhile: nothing left to free
        plain(comm).Free()


_user_keyval: int | None = None


def _freed(comm: Any, keyval: int, value: Any) -> None:
    """MPI deletes the attribute: the communicator is being freed (by whoever holds it)."""
    with _lock:
        rec = _records.pop(comm.handle, None)
        if rec is not None:
            history.append((rec, "freed"))


def forget_when_freed(comm: Any) -> None:
    """A communicator made for the user (``mpicoll.Comm.Dup``), which the user frees: its
    record goes when MPI frees it, so that :func:`release_all` never frees its handle
    again (MPI reuses handles: that freed another communicator, or one twice)."""
    global _user_keyval
    if comm == MPI.COMM_NULL:
        return
    with _lock:
        if _user_keyval is None:
            _user_keyval = MPI.Comm.Create_keyval(delete_fn=_freed)
    comm.Set_attr(_user_keyval, True)


def forget(comms: Iterable[Any]) -> None:
    """Drop ``comms`` from the registry without freeing them (a failed world's)."""
    with _lock:
        for comm in comms:
            if isinstance(comm, MPI.Comm) and comm != MPI.COMM_NULL:
                rec = _records.pop(comm.handle, None)
                if rec is not None:
                    history.append((rec, "forgotten"))
                    _forgotten[comm.handle] = rec.world


def descendants(comm: Any) -> list[Record]:
    """The live records made from ``comm``, directly or through others made from it."""
    with _lock:
        records = list(_records.values())
    found: list[Record] = []
    parents = {comm.handle}
    while True:
        more = [r for r in records if r.parent in parents and r not in found]
        if not more:
            return found
        found += more
        parents = {r.comm.handle for r in more}


def of_world(world: int) -> list[Record]:
    """The live records of world generation ``world``."""
    with _lock:
        return [r for r in _records.values() if r.world == world]


def alive() -> list[Record]:
    """Every live record (made, neither freed nor forgotten)."""
    with _lock:
        return list(_records.values())


def release_world(world: int) -> None:
    """At a reconfiguration: a failed world's communicators are all forgotten (they are
    revoked; nothing can run on them, and a free would wait for the dead), whoever owns
    them; of a healthy world (a growth), those whose lifetime is the world's are freed."""
    failed = _world.failed(world)
    for rec in of_world(world):
        if failed or rec.lifetime == "world":
            free(rec.comm)        # (a failed world's: only forgotten)


def release_all() -> None:
    """At exit, after the clients' own exit handlers: free (or, for a failed world's,
    forget) every communicator still alive, so that none outlives the runtime.

    A growth's intercommunicators are freed too: Open MPI 5.0.11's ``MPI_Finalize``
    disconnects every communicator still spanning two of its jobs, and in a process that
    holds two or more (one that joined a growth and took part in the next) that crashed
    (a null host name in its TCP transport, the job's status 1); with them freed it has
    none to disconnect."""
    for rec in alive():
        free(rec.comm)
