"""Process failures in the backend's groups (ULFM), over :mod:`mpicoll.runtime.failures`.

Under an MPI with ULFM turned on (:data:`mpicoll.runtime.failures.ENABLED`), a peer that
dies makes the group's operations fail: the runtime translates the MPI error into a
:class:`~mpicoll.ProcessFailedError`, marks the world failed and revokes every
communicator of it (the group's, its point-to-point duplicate, mpicoll's for it), so a
survivor waiting on another survivor wakes too. Each group has one :class:`GroupFailures`,
which names the failed ranks as ranks of the group and refuses every later operation at
once with the same error. Waits that poll (point-to-point, ``monitored_barrier``) also ask
MPI every :data:`POLL_S` seconds whether a rank of the group has failed
(:meth:`GroupFailures.poll`), so a receive from a live rank ends too. Without ULFM nothing
here does anything: a failure ends the job.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from mpi4py import MPI

from ...errors import ProcessFailedError
from ...runtime import Lane, failures

__all__ = ["GroupFailures", "watched_creation", "creation_failure", "POLL_S",
           "CREATE_GRACE_S"]

#: How often (seconds) a polling wait asks MPI whether a rank of the group has failed.
POLL_S = 0.02
#: How long (seconds) a group's creation may go on once a member is known to have failed.
CREATE_GRACE_S = 1.0


class GroupFailures:
    """The process failure of one group, once there is one.

    Args:
        comm: the group's communicator (ranks in group order).
    """

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        #: The failed ranks of the group (``None`` while it works).
        self.ranks: list[int] | None = None
        self._next_poll = 0.0

    def error(self, kind: str, exc: BaseException) -> BaseException:
        """The error operation ``kind`` reports for ``exc``: the group's
        :class:`~mpicoll.ProcessFailedError` when ``exc`` is a process failure, or any
        error while MPI knows a rank of the group to have failed, else ``exc`` itself."""
        if not failures.ENABLED or not isinstance(exc, Exception):
            return exc
        if not isinstance(exc, (MPI.Exception, ProcessFailedError)) and \
                not failures.peer_failed(self.comm):
            return exc   # a bad argument, a mismatch (mpi4py's unpickling of what a
                         # collective cut short counts once a peer is known dead)
        error = failures.translate(exc, self.comm, kind, wait_s=failures.OTHER_WAIT_S)
        if not isinstance(error, ProcessFailedError):
            return exc
        if self.ranks is None:
            self.ranks = list(error.failed_ranks) or failures.failed_ranks(self.comm)
        return self.refused(kind, exc)

    def poll(self, kind: str) -> ProcessFailedError | None:
        """The error of operation ``kind`` when MPI knows a rank of the group to have
        failed (asked at most every :data:`POLL_S` seconds; the world is then failed and
        its communicators revoked)."""
        if self.ranks is not None or not failures.ENABLED:
            return self.refuse(kind)
        now = time.monotonic()
        if now < self._next_poll:
            return None
        self._next_poll = now + POLL_S
        ranks = failures.failed_ranks(self.comm, 0.0)
        if not ranks:
            return None
        failures.fail_world(self.comm, ranks)
        self.ranks = ranks
        return self.refused(kind)

    def refuse(self, kind: str) -> ProcessFailedError | None:
        """The error of operation ``kind`` on a group that has failed, else ``None``."""
        return None if self.ranks is None else self.refused(kind)

    def refused(self, kind: str, cause: BaseException | None = None) -> ProcessFailedError:
        """A :class:`~mpicoll.ProcessFailedError` for operation ``kind`` (the group has
        failed)."""
        error = ProcessFailedError(
            f"mpicoll: {kind}: rank(s) {self.ranks} of the process group failed (this is "
            f"rank {self.comm.Get_rank()} of {self.comm.Get_size()}); the group's "
            f"communicators are revoked and it cannot be used any more", self.ranks)
        error.__cause__ = cause
        return error


def watched_creation(build: Callable[[], Any], world: Any, members: list[int],
                     made: list[Any]) -> Any:
    """``build()`` (which makes a group of the ``members`` of ``world``, appending the
    communicators it makes to ``made``), on a runtime lane of its own under ULFM: Open MPI
    5.0.11's ``MPI_Comm_create_group`` can wait forever for a member that died, and a
    revocation does not end it. When MPI knows a member to have failed and ``build`` has
    not ended :data:`CREATE_GRACE_S` seconds later, the lane is aborted (its thread left
    waiting in MPI), the communicators made so far are revoked and
    :class:`~mpicoll.ProcessFailedError` is raised here. Without ULFM, ``build()`` here."""
    if not (failures.ENABLED and members):
        return build()
    work = Lane("mpicoll-create-group").submit("new_group", build)
    deadline = None
    while not work.done():
        time.sleep(POLL_S)
        if deadline is None:
            dead = set(members) & set(failures.failed_ranks(world, 0.0))
            if dead:
                deadline = time.monotonic() + CREATE_GRACE_S
        elif time.monotonic() >= deadline:
            error = ProcessFailedError("group creation stuck on a failed member",
                                       sorted(dead))
            for comm in made:
                failures.revoke(comm)
            work.lane.abort(error)
    return work.result()


def creation_failure(exc: BaseException, world: Any, members: list[int],
                     created: Any = None) -> ProcessFailedError | None:
    """The :class:`~mpicoll.ProcessFailedError` of a group whose creation over the ranks
    ``members`` of ``world`` (``[]``: all) failed with ``exc`` (a process failure, or any
    error while MPI knows a member to have failed), naming the failed members as group
    ranks; ``created`` (a communicator made before the failure) is revoked, so members
    still creating wake. ``None``: no process failure (or no ULFM)."""
    if not failures.ENABLED:
        return None
    members = members or list(range(world.Get_size()))
    failure = failures.failed_by(exc, world) is not None
    dead = failures.failed_ranks(world, failures.FAILED_WAIT_S if failure
                                 else failures.OTHER_WAIT_S)
    ranks = [members.index(r) for r in dead if r in members]
    if not failure and not ranks:
        return None
    failures.fail_world(world if created is None or created == MPI.COMM_NULL else created,
                        dead)
    error = ProcessFailedError(
        f"mpicoll: creating the process group of ranks {members} failed: rank(s) {ranks} "
        f"of it failed (world ranks {dead})", ranks)
    error.__cause__ = exc
    return error
