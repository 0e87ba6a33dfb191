"""Process failures in the parameter server's protocol (ULFM), over
:mod:`mpicoll.runtime.failures`.

Without ULFM (:data:`mpicoll.runtime.failures.ENABLED` false: the MPICH wheel, or Open MPI
without ``--with-ft ulfm``) the parameter server makes no watch: an MPI error propagates
as before and a dead rank ends the job.

With ULFM every wait of the protocol (a server's loop, a worker's wait for replies, a
co-located or node group's step) goes through the rank's :class:`FailureWatch`, which
learns of failed ranks two ways: an MPI call that fails with a process failure (as
:func:`~mpicoll.runtime.failures.failed_by` classifies it; an ``MPI_ANY_SOURCE`` probe
fails once any rank of the communicator has failed), and a look at the failed ranks every
:data:`POLL_S` seconds (a rank waiting on a live peer may not be told otherwise). The
failures are then acknowledged (:func:`~mpicoll.runtime.failures.acknowledge`), so that
``MPI_ANY_SOURCE`` probes work again: point-to-point traffic between live ranks goes on,
on the same communicator, as long as nobody revokes it.

What happens next is the caller's choice: with ``replicas=0`` every failure is fatal
(:meth:`FailureWatch.fatal`: :func:`~mpicoll.runtime.failures.fail_world` marks the world
failed and revokes every communicator the runtime holds for it, the parameter server's
worker, node and leader communicators included, which wakes every survivor blocked on any
peer; :class:`~mpicoll.ProcessFailedError` names the failed ranks of the parameter
server's communicator); with replicas (a *tolerant* watch) the servers fail over and the
rounds go on without dead workers (:mod:`mpicoll.ps.replicated`), and only a lost slot or
a communicator revoked by another rank is fatal.
"""
from __future__ import annotations

import time
from typing import Any, Callable, NoReturn

from mpi4py import MPI

from ..errors import ProcessFailedError
from ..runtime import failures
from . import protocol as P

__all__ = ["FailureWatch", "POLL_S", "guarded"]

#: Seconds between two looks at the communicator's failed ranks while waiting.
POLL_S = 0.02
_WHAT = "the parameter server's protocol"


def guarded(watch: FailureWatch | None, step: Callable[[], Any],
            on_failure: Callable[[list[int]], None] | None = None) -> Any:
    """``step()``, under ``watch`` (:meth:`FailureWatch.guard`: a failure gives ``None``)
    when there is one."""
    return step() if watch is None else watch.guard(step, on_failure)


class FailureWatch:
    """Failed ranks of the parameter server's communicator, as this rank learns them.

    Args:
        comm: the parameter server's private communicator (failed ranks are named in it).
        tolerant: failures are acknowledged and handed to the caller (replicas); otherwise
            every failure is fatal.
    """

    def __init__(self, comm: MPI.Comm, tolerant: bool = False) -> None:
        self.comm = comm
        self.tolerant = tolerant
        #: failed ranks this rank knows of (from MPI, or from a peer's word)
        self.known: set[int] = set()
        #: failed ranks acknowledged to MPI (so MPI_ANY_SOURCE probes work again)
        self.acked: set[int] = set()
        self._next_poll = 0.0

    def refresh(self) -> list[int]:
        """Look now: acknowledge and return the failed ranks not known before."""
        ranks = set(failures.failed_ranks(self.comm, 0.0))
        if ranks - self.acked:
            self.acked |= ranks
            failures.acknowledge(self.comm)
        new = sorted(ranks - self.known)
        self.known |= set(new)
        return new

    def poll(self) -> list[int]:
        """Newly failed ranks, looked up at most every :data:`POLL_S` seconds."""
        now = time.monotonic()
        if now < self._next_poll:
            return []
        self._next_poll = now + POLL_S
        return self.refresh()

    def is_failure(self, exc: BaseException) -> bool:
        """Whether ``exc`` (from a call on the communicator) stands for a process failure."""
        return failures.failed_by(exc, self.comm) is not None

    def fatal(self, exc: BaseException | None = None) -> NoReturn:
        """Raise :func:`~mpicoll.runtime.failures.translate`'s error for ``exc`` (``None``:
        a failure this watch learnt of): a :class:`~mpicoll.ProcessFailedError` naming the
        failed ranks of the communicator, the world failed and every communicator of it
        revoked; ``exc`` itself when it is no process failure."""
        raise failures.translate(MPI.Exception(failures.PROC_FAILED) if exc is None else exc,
                                 self.comm, _WHAT, failures.OTHER_WAIT_S)

    def from_exception(self, exc: BaseException) -> list[int]:
        """The newly failed ranks an MPI error reports (a tolerant watch waits up to
        :data:`mpicoll.runtime.failures.FAILED_WAIT_S` for the detector to name one).

        Raises:
            exc: it is no process failure.
            ProcessFailedError: the failure is fatal: the watch is not tolerant, or the
                communicator no longer works between live ranks (another rank revoked it).
        """
        if not self.tolerant:
            self.fatal(exc)
        if failures.failed_by(exc, self.comm, failures.OTHER_WAIT_S) is None and \
                not self.known:
            raise exc   # another class (MPI_ERR_IN_STATUS from a wait on several
            # requests) stands for a failure only when a peer is known to have failed
        deadline = time.monotonic() + failures.FAILED_WAIT_S
        while True:
            new = self.refresh()
            if new:
                return new
            if not failures.revoked(self.comm):
                return []           # the call involved a rank already known dead
            if time.monotonic() >= deadline:
                self.fatal(exc)
            time.sleep(0.001)

    def guard(self, step: Callable[[], Any],
              on_failure: Callable[[list[int]], None] | None = None) -> Any:
        """Run ``step``; on a process failure hand the newly failed ranks to
        ``on_failure`` (default: :meth:`fatal`) and return ``None``."""
        try:
            result = step()
        except MPI.Exception as exc:
            new, result = self.from_exception(exc), None
        else:
            new = self.poll()
        if new:
            (on_failure or (lambda _: self.fatal()))(new)
        return result

    def wait(self, reqs: list[MPI.Request], max_sleep: float, busy: bool = False) -> None:
        """Complete ``reqs`` by polling under the watch, every failure fatal (the requests
        are then kept, never freed: :func:`~mpicoll.runtime.failures.keep_requests`)."""
        backoff = P.Backoff(max_sleep=max_sleep)
        try:
            while not self.guard(lambda: MPI.Request.Testall(reqs)):
                backoff.pause(busy=busy)
        except ProcessFailedError:
            failures.keep_requests(reqs)
            raise
