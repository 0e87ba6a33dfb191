"""Process failures in the backend's groups: :class:`mpicoll.ProcessFailedError` (ULFM).

Under an MPI with ULFM turned on (:data:`mpicoll.faults.ENABLED`), a peer that dies makes
the group's MPI calls fail with ``MPI_ERR_PROC_FAILED``, or raise mpicoll's
:class:`~mpicoll.ProcessFailedError` where the group runs mpicoll's collectives. Each
group has one :class:`GroupFailures`: every error of the group's operations (its
collectives, its own MPI calls, the agreement step, point-to-point requests,
``monitored_barrier``) passes through :meth:`GroupFailures.translate`, which turns a
process failure into a :class:`~mpicoll.ProcessFailedError` naming the failed ranks of
the group and revokes every communicator of the group (the group's, the ones mpicoll
holds for it, and the point-to-point duplicate), so that a survivor waiting on another
survivor wakes with the same error. Waits that poll (point-to-point, ``monitored_barrier``)
also ask MPI every :data:`POLL_S` seconds whether a rank of the group has failed
(:meth:`GroupFailures.poll`), so a receive from a live rank ends too.

After a failure the group is unusable: every later operation fails at once with a
:class:`~mpicoll.ProcessFailedError` naming the same ranks (:meth:`GroupFailures.refuse`).
Without ULFM nothing here does anything: a failure ends the job, as before.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from mpi4py import MPI

from ... import faults
from ...errors import ProcessFailedError

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
        p2p: the group's point-to-point duplicate (revoked with ``comm``).
    """

    def __init__(self, comm: Any, p2p: Any) -> None:
        self.comm, self.p2p = comm, p2p
        #: The first failure (``None`` while the group works).
        self.failure: ProcessFailedError | None = None
        self._lock = threading.Lock()
        self._next_poll = 0.0

    def translate(self, kind: str, exc: BaseException) -> BaseException:
        """The error that operation ``kind`` reports for ``exc``: a
        :class:`~mpicoll.ProcessFailedError` when ``exc`` is a process failure, or any
        error while MPI knows a rank of the group to have failed (the group is then
        revoked), else ``exc`` itself."""
        if not faults.ENABLED or not isinstance(exc, Exception):
            return exc
        if self.failure is None:
            if isinstance(exc, (MPI.Exception, ProcessFailedError)):
                failure = faults.as_process_failure(exc, self.comm)
                ranks = failure.failed_ranks if failure is not None else None
            else:   # e.g. mpi4py unpickling what a collective cut short left behind
                ranks = faults.failed_ranks(self.comm, 0.0) or None
            if ranks is None:
                return exc
            self._record(ranks, exc)
        elif not isinstance(exc, (MPI.Exception, ProcessFailedError)) and \
                not faults.failed_ranks(self.comm, 0.0):
            return exc
        return self.refused(kind, exc)

    def poll(self, kind: str) -> ProcessFailedError | None:
        """The error of operation ``kind`` when MPI knows a rank of the group to have
        failed (asked at most every :data:`POLL_S` seconds; the group is then revoked)."""
        if self.failure is not None:
            return self.refused(kind)
        if not faults.ENABLED:
            return None
        now = time.monotonic()
        if now < self._next_poll:
            return None
        self._next_poll = now + POLL_S
        ranks = faults.failed_ranks(self.comm, 0.0)
        if not ranks:
            return None
        self._record(ranks, None)
        return self.refused(kind)

    def refuse(self, kind: str) -> ProcessFailedError | None:
        """The error of operation ``kind`` on a group that has failed, else ``None``."""
        return None if self.failure is None else self.refused(kind)

    def refused(self, kind: str, cause: BaseException | None = None) -> ProcessFailedError:
        """A :class:`~mpicoll.ProcessFailedError` for operation ``kind`` (the group has
        failed)."""
        failure = self.failure
        assert failure is not None
        error = ProcessFailedError(
            f"mpicoll: {kind}: rank(s) {failure.failed_ranks} of the process group failed "
            f"(this is rank {self.comm.Get_rank()} of {self.comm.Get_size()}); the group's "
            f"communicators are revoked and it cannot be used any more",
            failure.failed_ranks)
        error.__cause__ = cause if cause is not None else failure.__cause__
        return error

    def _record(self, ranks: list[int], cause: BaseException | None) -> None:
        with self._lock:
            if self.failure is not None:
                return
            faults.note_failure()
            for comm in (self.comm, self.p2p):
                faults.revoke_all(comm)
            failure = ProcessFailedError("process group failed", ranks)
            failure.__cause__ = cause
            self.failure = failure


def watched_creation(build: Callable[[], Any], world: Any, members: list[int],
                     made: list[Any]) -> Any:
    """``build()`` (which makes a group of the ``members`` of ``world``, appending the
    communicators it makes to ``made``), on a thread of its own under ULFM: Open MPI
    5.0.11's ``MPI_Comm_create_group`` can wait forever for a member that died, and a
    revocation does not end it. When MPI knows a member to have failed and ``build`` has
    not ended :data:`CREATE_GRACE_S` seconds later, the communicators made so far are
    revoked and :class:`~mpicoll.ProcessFailedError` is raised here; the thread is left
    waiting in MPI (the process's exit does not wait for it:
    :func:`mpicoll.faults.finalize_or_exit`). Without ULFM (or below
    ``MPI_THREAD_MULTIPLE``), ``build()`` on this thread."""
    if not (faults.ENABLED and members and MPI.Query_thread() >= MPI.THREAD_MULTIPLE):
        return build()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = build()
        except BaseException as exc:  # noqa: BLE001  (raised on the caller's thread)
            box["error"] = exc

    thread = threading.Thread(target=run, name="mpicoll-create-group", daemon=True)
    thread.start()
    deadline = None
    while True:
        thread.join(POLL_S)
        if not thread.is_alive():
            if "error" in box:
                raise box["error"]
            return box["value"]
        if deadline is None:
            dead = set(members) & set(faults.failed_ranks(world, 0.0))
            if dead:
                deadline = time.monotonic() + CREATE_GRACE_S
        elif time.monotonic() >= deadline:
            for comm in list(made):
                faults.revoke_all(comm)
            raise ProcessFailedError("group creation stuck on a failed member",
                                     sorted(dead))


def creation_failure(exc: BaseException, world: Any, members: list[int],
                     created: Any = None) -> ProcessFailedError | None:
    """The :class:`~mpicoll.ProcessFailedError` of a group whose creation over the ranks
    ``members`` of ``world`` (``[]``: all) failed with ``exc`` (an MPI process failure,
    or any error while MPI knows a member to have failed), naming the failed members as
    group ranks; ``created`` (a communicator made before the failure) is revoked, so
    members still creating wake. ``None``: no process failure (or no ULFM)."""
    if not faults.ENABLED:
        return None
    members = members or list(range(world.Get_size()))
    failure = isinstance(exc, ProcessFailedError) or faults.is_process_failure(exc)
    # another error (mpi4py unpickling what a collective cut short left behind) counts
    # when MPI knows a member to have failed
    dead = faults.failed_ranks(world, faults.FAILED_WAIT_S if failure
                               else faults.OTHER_WAIT_S)
    ranks = [members.index(r) for r in dead if r in members]
    if not failure and not ranks:
        return None
    if created is not None and created != MPI.COMM_NULL:
        faults.revoke_all(created)
    faults.note_failure()
    error = ProcessFailedError(
        f"mpicoll: creating the process group of ranks {members} failed: rank(s) {ranks} "
        f"of it failed (world ranks {dead})", ranks)
    error.__cause__ = exc
    return error
