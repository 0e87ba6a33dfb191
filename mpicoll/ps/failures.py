"""Process failures in the parameter server's protocol (ULFM).

Without ULFM (``mpicoll.faults.ENABLED`` false: the MPICH wheel, or Open MPI without
``--with-ft ulfm``) nothing here does anything: an MPI error propagates as before and a
dead rank ends the job.

With ULFM every wait of the protocol (a server's loop, a worker's wait for replies) goes
through a :class:`FailureWatch`, which learns of failed ranks two ways: an MPI call that
raises a process-failure error (an ``MPI_ANY_SOURCE`` probe does once any rank of the
communicator has failed), and a look at ``MPI_Comm_get_failed`` every
:data:`POLL_S` seconds (a rank waiting on a live peer may not be told otherwise). The
failures are then *acknowledged* (``MPI_Comm_ack_failed``), so that ``MPI_ANY_SOURCE``
probes work again: point-to-point traffic between live ranks goes on, on the same
communicator, as long as nobody revokes it.

What happens next is the caller's choice: with ``replicas=0`` every failure is fatal
(:meth:`FailureWatch.fatal`: the parameter server's communicators are revoked, which
wakes every survivor blocked on any peer, and :class:`~mpicoll.ProcessFailedError` naming
the failed ranks is raised); with replicas the servers fail over and the rounds go on
without dead workers (:mod:`mpicoll.ps.replicated`).
"""
from __future__ import annotations

import time
from typing import Any, Callable, NoReturn

from mpi4py import MPI

from .. import faults
from ..errors import ProcessFailedError

__all__ = ["FailureWatch", "POLL_S"]

#: Seconds between two looks at the communicator's failed ranks while waiting.
POLL_S = 0.02
#: Longest wait for a failed rank to be named after an MPI error of another class.
OTHER_WAIT_S = 0.2


class FailureWatch:
    """Failed ranks of the parameter server's communicator, as this rank learns them.

    Args:
        comm: the parameter server's private communicator.
        comms: every communicator to revoke on a fatal failure (``comm`` included), as a
            callable (the worker communicator is made after the watch).
    """

    def __init__(self, comm: MPI.Comm, comms: Callable[[], list[MPI.Comm]]) -> None:
        self.comm = comm
        self.comms = comms
        self.enabled = faults.ENABLED
        #: failed ranks this rank knows of (from MPI, or from a peer's word)
        self.known: set[int] = set()
        #: failed ranks acknowledged to MPI (so MPI_ANY_SOURCE probes work again)
        self.acked: set[int] = set()
        self._next_poll = 0.0

    def refresh(self) -> list[int]:
        """Look now: acknowledge and return the failed ranks not known before."""
        ranks = set(faults.failed_ranks(self.comm, 0.0))
        if ranks - self.acked:
            self.acked |= ranks
            try:
                self.comm.Ack_failed()
            except MPI.Exception:  # revoked: the next call raises ERR_REVOKED anyway
                pass
        new = sorted(ranks - self.known)
        self.known |= set(new)
        return new

    def poll(self) -> list[int]:
        """Newly failed ranks, looked up at most every :data:`POLL_S` seconds."""
        if not self.enabled:
            return []
        now = time.monotonic()
        if now < self._next_poll:
            return []
        self._next_poll = now + POLL_S
        return self.refresh()

    def from_exception(self, exc: BaseException) -> list[int]:
        """The newly failed ranks an MPI error reports (waiting up to
        :data:`mpicoll.faults.FAILED_WAIT_S` for the detector to name one).

        Raises:
            exc: it is no process failure, or ULFM is off.
            ProcessFailedError: the communicator was revoked (another rank found the
                failure fatal): raised here too.
        """
        if not self.enabled or not isinstance(exc, MPI.Exception):
            raise exc
        if not faults.is_process_failure(exc) and not (
                self.known or faults.failed_ranks(self.comm, OTHER_WAIT_S)):
            raise exc   # another class (MPI_ERR_IN_STATUS from a wait on several
            # requests) stands for a failure only when a peer is known to have failed
        if exc.Get_error_class() == getattr(MPI, "ERR_REVOKED", -1):
            self.fatal(exc)
        deadline = time.monotonic() + faults.FAILED_WAIT_S
        while True:   # wait only while no failure at all is known here yet
            new = self.refresh()
            if new or self.known or time.monotonic() >= deadline:
                return new
            time.sleep(0.001)

    def fatal(self, exc: BaseException | None = None,
              ranks: list[int] | None = None) -> NoReturn:
        """Revoke the parameter server's communicators and raise
        :class:`ProcessFailedError` naming the failed ranks."""
        for c in self.comms():
            faults.revoke_all(c)
        named = sorted(set(ranks or []) | self.known |
                       set(faults.failed_ranks(self.comm, faults.FAILED_WAIT_S)))
        raise ProcessFailedError(
            f"rank(s) {named} failed during the parameter server's protocol (rank "
            f"{self.comm.Get_rank()} of {self.comm.Get_size()}); its communicators are "
            f"revoked", named) from exc

    def guard(self, step: Callable[[], Any], on_failure: Callable[[list[int]], None]) -> Any:
        """Run ``step``; on a process failure hand the newly failed ranks to
        ``on_failure`` (which may call :meth:`fatal`) and return ``None``."""
        try:
            result = step()
        except MPI.Exception as exc:
            if not self.enabled:
                raise
            new = self.from_exception(exc)
            if new:
                on_failure(new)
            return None
        new = self.poll()
        if new:
            on_failure(new)
        return result
