"""Operations written as generators of MPI requests, driven to completion by a handle.

An operation (a co-located step, a node group's step) is a generator that yields what it
waits for next (a list of requests, or another handle) and returns its result.
:class:`SteppedHandle` runs it up to each wait, on the caller's thread (in ``test()`` and
``wait()``: no thread of its own), and keeps its result or its error for ``wait()``. A
:class:`SteppedOwner` runs one operation at a time and waits on requests under its
failure watch (:mod:`mpicoll.ps.failures`) when it has one. A :class:`CollectiveGroup`
is an owner whose push, pull and push_pull are collective over its communicator.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Generator, Iterator, NoReturn

import numpy as np
from mpi4py import MPI

from . import protocol as P
from .device import DevicePull, call_side, device_views, first_device, host_arrays
from .errors import PSError
from .failures import guarded
from .protocol import CollOp
from .worker import check_arrays, check_out_names, pull_destination

__all__ = ["SteppedHandle", "SteppedOwner", "GroupCall", "CollectiveGroup"]


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
                with contextlib.suppress(PSError):
                    pending.wait()      # another handle: the steps see its error
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
            with contextlib.suppress(PSError):
                self._current.wait()

    def wait(self, reqs: list[MPI.Request], busy: bool = False) -> None:
        """Complete ``reqs`` by polling (a blocking wait would spin on shared cores), under
        the failure watch when there is one; ``busy``: a large message of ours is in
        flight (see :meth:`~mpicoll.ps.protocol.Backoff.pause`)."""
        if self.watch is not None:
            self.watch.wait(reqs, self.max_sleep, busy)
        else:
            P.wait_all(reqs, max_sleep=self.max_sleep, busy=busy)

    def test(self, reqs: list[MPI.Request]) -> bool:
        """Whether ``reqs`` are complete (under the failure watch when there is one)."""
        return bool(guarded(self.watch, lambda: MPI.Request.Testall(reqs)))

    def failure(self, exc: BaseException) -> BaseException:
        """The error an operation that raised ``exc`` reports: under ULFM a process
        failure is a :class:`~mpicoll.ProcessFailedError` (the world revoked)."""
        if self.watch is None or not isinstance(exc, MPI.Exception):
            return exc
        try:
            self.watch.fatal(exc)
        except BaseException as error:  # noqa: BLE001  (exc itself when no failure)
            return error


@dataclass
class GroupCall:
    """One rank's arguments of a collective push, pull or push_pull, checked and staged
    (:meth:`CollectiveGroup._prepare`)."""

    pushing: bool
    pulling: bool
    #: the gradients, in host memory (``None`` unless pushing)
    grads: dict[str, Any] | None = None
    #: the host arrays the pull fills (``None`` unless pulling)
    result: dict[str, np.ndarray] | None = None
    #: with device ``out`` arrays: their host staging arrays are ``result``
    device: DevicePull | None = None
    #: why this rank's arguments are bad (``None``: they are good)
    error: str | None = None

    def finish(self) -> dict[str, Any] | None:
        """The pulled dict once the data step is done: ``result``, or the device arrays
        (their staging arrays copied in)."""
        if self.device is None:
            return self.result
        self.device.finish()
        return self.device.arrays


class CollectiveGroup(SteppedOwner):
    """A :class:`SteppedOwner` whose push, pull and push_pull are collective over
    ``comm`` (a co-located engine, a node group): each step starts with a control
    all-gather of ``(op, clock, error flag)`` per rank, so that every rank either goes on
    or raises the same :class:`PSError` (bad arguments are reported, never raised on one
    rank alone). Subclasses call :meth:`_setup_group`."""

    def _setup_group(self, comm: MPI.Comm) -> None:
        self.comm = comm
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self.clock = 0
        self._ctrl_out = np.zeros(3, dtype=np.int64)
        self._ctrl_in = np.zeros((self.size, 3), dtype=np.int64)

    def _control(self, op: int, error: str | None) -> Iterator[list]:
        """All-gather (op, clock, error flag); leaves the table in ``self._ctrl_in``."""
        self._ctrl_out[:] = (int(op), self.clock, 1 if error else 0)
        yield [self.comm.Iallgather([self._ctrl_out, MPI.INT64_T],
                                    [self._ctrl_in, MPI.INT64_T])]

    @staticmethod
    def _refuse_bad_arguments(who: str, error: str | None, peers: str) -> NoReturn:
        """Raise the error of a step some rank (``who``) passed bad arguments to; this
        rank's own reason (``error``) is in it, else a pointer to the other ``peers``."""
        mine = f": {error}" if error else f" (see the error on those {peers})"
        raise PSError(f"{who} passed bad arguments, nothing was sent{mine}",
                      [error] if error else [])

    def _check_call(self, op: int) -> None:
        """Refuse ``op`` on this rank before its arrays are looked at (raises
        :class:`PSError`); nothing to refuse here."""

    def _prepare(self, op: int, grads: dict[str, Any] | None, out: dict[str, Any] | None,
                 specs: dict[str, Any]) -> GroupCall:
        """Check this rank's arguments of ``op`` and stage them: device gradients are
        copied to host memory now (the caller may reuse them), a pull gets its host arrays
        (staging arrays for device ``out`` arrays). Gradients are always checked
        (``push(check=False)`` included): once the bytes are sent there is no server left
        to reject them. A bad argument becomes the call's ``error``."""
        call = GroupCall(op in (CollOp.PUSH, CollOp.PUSH_PULL),
                         op in (CollOp.PULL, CollOp.PUSH_PULL))
        try:
            device = call_side(grads=grads if call.pushing else None,
                               out=out if call.pulling else None)
            self._check_call(op)
            if call.pulling:
                check_out_names(specs, out)
            if call.pushing:
                check_arrays(specs, device_views(grads) if device else grads, complete=True,
                             what="gradient")
                call.grads = host_arrays(grads) if device else grads
            if call.pulling and device:
                call.device = DevicePull(out, first_device(grads if call.pushing else None,
                                                           out))
                call.result = {n: call.device.destination(n, s)[0] for n, s in specs.items()}
            elif call.pulling:
                call.result = {n: pull_destination(s, out) for n, s in specs.items()}
        except PSError as exc:
            call.error = str(exc)
        except (TypeError, ValueError) as exc:   # reported to the group, not raised alone
            call.error = f"{type(exc).__name__}: {exc}"
        return call

    def _advance(self, call: GroupCall, counters: dict[str, int]) -> None:
        """After this rank's data step: a push moves its clock on; count the call."""
        if call.pushing:
            self.clock += 1
            counters["pushes"] += 1
        if call.pulling:
            counters["pulls"] += 1
