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
from typing import Any

from mpi4py import MPI

from ...errors import ProcessFailedError
from ...runtime import failures

__all__ = ["GroupFailures", "POLL_S"]

#: How often (seconds) a polling wait asks MPI whether a rank of the group has failed.
POLL_S = 0.02


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
        error while MPI knows a rank of the group to have failed; a
        :class:`~mpicoll.CollectiveError` when another rank revoked the group's
        communicator with no process failed (an abort there); else ``exc`` itself."""
        if not failures.ENABLED or not isinstance(exc, Exception):
            return exc
        if not isinstance(exc, (MPI.Exception, ProcessFailedError)) and \
                not failures.peer_failed(self.comm):
            return exc   # a bad argument, a mismatch (mpi4py's unpickling of what a
                         # collective cut short counts once a peer is known dead)
        error = failures.translate(exc, self.comm, kind, wait_s=failures.OTHER_WAIT_S)
        if not isinstance(error, ProcessFailedError):
            return error   # exc itself, or a peer's revocation (an abort there): its error
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
