"""Operations written as generators of MPI requests, driven to completion by a handle.

An operation (a co-located step, a node group's step) is a generator that yields what it
waits for next (a list of requests, or another handle) and returns its result.
:class:`SteppedHandle` runs it up to each wait, on the caller's thread (in ``test()`` and
``wait()``: no thread of its own), and keeps its result or its error for ``wait()``. A
:class:`SteppedOwner` runs one operation at a time and waits on requests under its
failure watch (:mod:`mpicoll.ps.failures`) when it has one.
"""
from __future__ import annotations

from typing import Any, Generator

from mpi4py import MPI

from . import protocol as P
from .errors import PSError

__all__ = ["SteppedHandle", "SteppedOwner"]


class SteppedHandle:
    """An outstanding operation of a :class:`SteppedOwner` (the interface of
    :class:`~mpicoll.ps.Handle`): ``wait()`` completes it and returns its result,
    ``test()`` makes progress without blocking. Starting another operation of the same
    owner first completes this one.

    Args:
        owner: the :class:`SteppedOwner` that runs it.
        kind: the operation's name (``"push"``, ``"pull"``, ``"push_pull"``...).
        steps: the operation's generator (started here, up to its first wait).
    """

    def __init__(self, owner: "SteppedOwner", kind: str,
                 steps: Generator[Any, None, Any]) -> None:
        self.kind = kind
        self._owner = owner
        self._steps = steps
        self._reqs: Any = []
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None
        self._advance()

    def _advance(self) -> None:
        """Run the operation up to its next wait (or its end)."""
        try:
            self._reqs = self._steps.send(None)
        except StopIteration as stop:
            self._done, self._result = True, stop.value
        except BaseException as exc:  # noqa: BLE001  (re-raised by wait())
            self._done, self._error = True, self._owner.failure(exc)
        if self._done:
            self._owner.finished(self)

    def test(self) -> bool:
        """Make progress; whether the operation is complete (its own errors are raised by
        :meth:`wait`)."""
        while not self._done:
            pending = self._reqs
            if isinstance(pending, list):
                if pending and not self._owner.test(pending):
                    return False
            elif not pending.test():
                return False
            self._advance()
        return True

    def wait(self) -> Any:
        """Complete the operation and return its result.

        Raises:
            PSError: ranks disagreed on the operation, one passed bad arrays, or a server
                rejected the request.
            ProcessFailedError: (under ULFM) a rank failed.
        """
        while not self._done:
            pending = self._reqs
            if isinstance(pending, list):
                self._owner.wait(pending)
            else:
                try:
                    pending.wait()      # another handle: the steps see its error
                except PSError:
                    pass
            self._advance()
        if self._error is not None:
            raise self._error
        return self._result


class SteppedOwner:
    """Runs :class:`SteppedHandle` operations one at a time (a co-located engine, a node
    group). Subclasses set :attr:`max_sleep` and, under ULFM, :attr:`watch`."""

    #: longest pause while polling, in seconds
    max_sleep = 1e-3
    #: the failure watch under ULFM (:class:`~mpicoll.ps.failures.FailureWatch`; ``None``:
    #: not watched)
    watch: Any = None
    _current: SteppedHandle | None = None

    def start(self, kind: str, steps: Generator[Any, None, Any]) -> SteppedHandle:
        """Complete the running operation (if any), then start ``steps``."""
        self.wait_current()
        self._current = SteppedHandle(self, kind, steps)
        return self._current

    def finished(self, handle: SteppedHandle) -> None:
        """Forget ``handle`` as the running operation once it has completed."""
        if self._current is handle:
            self._current = None

    def wait_current(self) -> None:
        """Complete the running operation, if any (its errors stay with its handle, raised
        by that handle's own ``wait()``)."""
        if self._current is not None:
            try:
                self._current.wait()
            except PSError:
                pass

    def wait(self, reqs: list[MPI.Request], busy: bool = False) -> None:
        """Complete ``reqs`` by polling (a blocking wait would spin on shared cores), under
        the failure watch when there is one; ``busy``: a large message of ours is in
        flight (see :meth:`~mpicoll.ps.protocol.Backoff.pause`)."""
        if self.watch is not None:
            self.watch.wait(reqs, self.max_sleep, busy)
            return
        backoff = P.Backoff(max_sleep=self.max_sleep)
        while not MPI.Request.Testall(reqs):
            backoff.pause(busy=busy)

    def test(self, reqs: list[MPI.Request]) -> bool:
        """Whether ``reqs`` are complete (under the failure watch when there is one)."""
        if self.watch is None:
            return MPI.Request.Testall(reqs)
        return bool(self.watch.guard(lambda: MPI.Request.Testall(reqs)))

    def failure(self, exc: BaseException) -> BaseException:
        """The error an operation that raised ``exc`` reports: under ULFM a process
        failure is a :class:`~mpicoll.ProcessFailedError` (the world revoked)."""
        if self.watch is None or not isinstance(exc, MPI.Exception):
            return exc
        try:
            self.watch.fatal(exc)
        except BaseException as error:  # noqa: BLE001  (exc itself when no failure)
            return error
