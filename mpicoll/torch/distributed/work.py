"""torch's ``Work`` for the backend's operations: a thin adapter around a runtime
:class:`mpicoll.runtime.Work`.

Each group's operations run on the group's :class:`mpicoll.runtime.Lane` (in call order,
on the lane's thread; inline below ``MPI_THREAD_MULTIPLE`` and for a call made from the
lane's own thread). :class:`MPIWork` hands torch the runtime work's state: ``wait()``
raises the operation's error, and ``get_future()`` completes (with the result or the
error) on the thread that completes the work, so callbacks chained with ``then`` run
there, as with gloo. A ``wait(timeout)`` that expires raises
:class:`mpicoll.CollectiveTimeoutError` (a ``RuntimeError``) at once and breaks the group
(the runtime's rules: :mod:`mpicoll.runtime.progress`). ``get_future_result()`` completes
with the outcome as torch's ``WorkResult`` number, never with an error.

torch's ``ProcessGroup`` hands callers a C++ ``WorkHandle`` of the extension
(:mod:`.extension`) that asks this object for everything and forwards any other
attribute to it.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import WorkResult
from torch.futures import Future

from ...errors import CollectiveTimeoutError
from ...runtime import Work, progress

__all__ = ["MPIWork", "completed", "seconds", "outcome"]


def seconds(timeout: Any) -> float | None:
    """A ``timedelta``/number of seconds as seconds; ``None`` or zero: no limit."""
    if timeout is None:
        return None
    value = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return value if value > 0 else None


def outcome(error: BaseException | None) -> int:
    """torch's ``WorkResult`` number for a work that ended with ``error`` (``None``:
    ``SUCCESS``; a :class:`mpicoll.CollectiveTimeoutError`: ``TIMEOUT``; any other error:
    ``COMM_ERROR``)."""
    if error is None:
        return int(WorkResult.SUCCESS.value)
    if isinstance(error, CollectiveTimeoutError):
        return int(WorkResult.TIMEOUT.value)
    return int(WorkResult.COMM_ERROR.value)


class MPIWork(dist.Work):
    """One operation of an mpicoll process group (torch's ``Work`` interface).

    Args:
        work: the runtime's work of the operation.
        fallback: what the future completes with if the work fails (``None``: the
            error); the work keeps the error (:mod:`.backward`: an operation DDP's
            reducer started).
    """

    def __init__(self, work: Work, fallback: Any = None) -> None:
        super().__init__()
        self.work = work
        self.kind = work.kind
        self._future: Future = Future()
        self._fallback = fallback
        #: The sender's rank for a receive from any source (``-1`` until known).
        self.source_rank = -1
        work.add_done_callback(self._complete_future)

    def _complete_future(self, work: Work) -> None:
        error = work.exception()
        if error is None:
            self._future.set_result(work.wait(0))
        elif self._fallback is not None:
            self._future.set_result(self._fallback)
        else:
            self._future.set_exception(error)

    # --- torch's Work interface -------------------------------------------------------
    def wait(self, timeout: Any = None) -> bool:
        """Block until the operation is done; raise its error. ``timeout`` (a
        ``timedelta``; zero or ``None``: the group's timeout) raises
        :class:`mpicoll.CollectiveTimeoutError` when it passes first (the group is then
        broken)."""
        self.work.wait(seconds(timeout))
        self._future.wait()   # done too (its callbacks may still be running)
        return True

    def is_completed(self) -> bool:  # noqa: D102 (torch's)
        return self.work.done()

    def is_success(self) -> bool:  # noqa: D102
        return self.work.done() and self.work.exception() is None

    def exception(self) -> BaseException | None:  # noqa: D102
        return self.work.exception()

    def get_future(self) -> Future:  # noqa: D102
        return self._future

    def get_future_result(self) -> Future:
        """A future that completes with the work's :func:`outcome` (an ``int``, torch's
        ``WorkResult``) when it ends, successful or not."""
        future: Future = Future()
        self.get_future().then(lambda _: future.set_result(outcome(self.work.exception())))
        return future

    def result(self) -> Any:  # noqa: D102
        self.wait()
        return self.work.wait(0)

    def _source_rank(self) -> int:
        self.wait()
        return self.source_rank

    def synchronize(self) -> None:  # noqa: D102
        self.wait()


def completed(kind: str, result: Any = None, error: BaseException | None = None) -> MPIWork:
    """A work that is already done (with ``error``: failed)."""
    return MPIWork(progress.completed(kind, result, error))
