"""``Work`` objects and the communication thread of each process group.

Every operation of a group runs, in the order it was called, on that group's own thread
(:class:`GroupWorker`); the call returns a :class:`MPIWork` at once. The work's
``wait()`` blocks until the operation is done and raises its exception, if any; its
``get_future()`` completes (with the result or the exception) on the group's thread, so
callbacks chained with ``then`` run there, as with gloo. An operation submitted from the
group's own thread (a future callback that calls another collective of the same group)
runs inline, so it cannot wait for itself.

At interpreter exit every group's thread finishes what is queued; a thread that makes no
progress for :data:`EXIT_STALL_SECONDS` (an operation that other ranks never joined) is
reported and the job is aborted with ``MPI_Abort`` rather than left to hang in
``MPI_Finalize``.
"""
from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist
from torch.futures import Future

__all__ = ["MPIWork", "GroupWorker", "finished", "finished_with_error", "seconds",
           "EXIT_STALL_SECONDS"]

log = logging.getLogger("mpicoll.torch.distributed")

#: At exit, how long a group's thread may go without finishing an operation before the
#: job is aborted (a collective that other ranks never joined).
EXIT_STALL_SECONDS = 10.0


def seconds(timeout: Any) -> float | None:
    """A ``timedelta``/number of seconds as seconds; ``None`` or zero: no limit."""
    if timeout is None:
        return None
    value = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return value if value > 0 else None


class MPIWork(dist.Work):
    """One operation of an mpicoll process group (torch's ``Work`` interface).

    Args:
        kind: the operation's name (shown in errors).
        timeout: seconds ``wait()`` waits by default (the group's timeout), ``None``: forever.
    """

    def __init__(self, kind: str, timeout: float | None = None) -> None:
        super().__init__()
        self.kind = kind
        self._timeout = timeout
        self._future: Future = Future()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._result: Any = None
        #: The sender's rank for a receive from any source (``-1`` until known).
        self.source_rank = -1

    def finish(self, result: Any, error: BaseException | None = None) -> None:
        """Complete the work: the future first (its callbacks run here), then ``wait()``."""
        self._result, self._error = result, error
        try:
            if error is None:
                self._future.set_result(result)
            else:
                self._future.set_exception(error)
        finally:
            self._done.set()

    # --- torch's Work interface -------------------------------------------------------
    def wait(self, timeout: Any = None) -> bool:
        """Block until the operation is done; raise its error. ``timeout`` (a
        ``timedelta``; zero or ``None``: the group's timeout) raises ``RuntimeError``
        when it passes first."""
        limit = seconds(timeout)
        if limit is None:
            limit = self._timeout
        if not self._done.wait(limit):
            raise RuntimeError(f"mpicoll: {self.kind} timed out after {limit:g} s waiting for "
                               f"the other ranks of its process group")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:  # noqa: D102 (torch's)
        return self._done.is_set()

    def is_success(self) -> bool:  # noqa: D102
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:  # noqa: D102
        return self._error

    def get_future(self) -> Future:  # noqa: D102
        return self._future

    def result(self) -> Any:  # noqa: D102
        self.wait()
        return self._result

    def _source_rank(self) -> int:
        self.wait()
        return self.source_rank

    def synchronize(self) -> None:  # noqa: D102
        self.wait()


def finished(kind: str, result: Any) -> MPIWork:
    """A work that is already done."""
    work = MPIWork(kind)
    work.finish(result)
    return work


def finished_with_error(kind: str, error: BaseException) -> MPIWork:
    """A work that has already failed with ``error``."""
    work = MPIWork(kind)
    work.finish(None, error)
    return work


_workers: "weakref.WeakSet[GroupWorker]" = weakref.WeakSet()
_exit_registered = False
_registry_lock = threading.Lock()


class GroupWorker:
    """The communication thread of one process group: a FIFO of operations.

    Args:
        name: the thread's name.
        timeout: the group's timeout in seconds (``MPIWork.wait``'s default).
        inline: run every operation on the calling thread instead (synchronous: for MPI
            below ``MPI_THREAD_MULTIPLE``, where only one thread may call MPI).
        failures: the group's :class:`~.failures.GroupFailures`: an operation's error
            passes through its ``translate``, and an operation on a failed group fails
            at once (``refuse``).
    """

    def __init__(self, name: str, timeout: float | None, inline: bool = False,
                 failures: Any = None) -> None:
        self.name = name
        self.timeout = timeout
        self.inline = inline
        self.failures = failures
        self.completed = 0
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, kind: str, run: Callable[[], Any]) -> MPIWork:
        """Queue ``run`` (whose return value is the work's result); return its work."""
        work = MPIWork(kind, self.timeout)
        if self._closed:
            raise RuntimeError(f"mpicoll: {kind} on a process group that was shut down")
        if self.inline or threading.current_thread() is self._thread:
            self._execute(work, run)
            return work
        self._start()
        self._queue.put((work, run))
        return work

    def _start(self) -> None:
        if self._thread is not None:
            return
        with self._lock:
            if self._thread is None:
                _register_exit()
                thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                thread.start()
                self._thread = thread
                _workers.add(self)

    def _execute(self, work: MPIWork, run: Callable[[], Any]) -> None:
        failures = self.failures
        refused = failures.refuse(work.kind) if failures is not None else None
        if refused is not None:   # the group has failed: nothing more runs on it
            work.finish(None, refused)
            self.completed += 1
            return
        try:
            result = run()
        except BaseException as exc:  # noqa: BLE001  (handed to the waiter)
            work.finish(None, exc if failures is None else failures.translate(work.kind, exc))
        else:
            work.finish(result)
        self.completed += 1

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._execute(*item)

    def close(self, stall_seconds: float | None = None) -> bool:
        """Finish what is queued and stop the thread (idempotent). Returns ``False`` when
        the thread made no progress for ``stall_seconds`` (it is left running)."""
        self._closed = True
        thread = self._thread
        if thread is None:
            return True
        if thread is threading.current_thread():
            return True
        self._queue.put(None)
        while True:
            before = self.completed
            thread.join(stall_seconds)
            if not thread.is_alive():
                self._thread = None
                return True
            if self.completed == before:
                return False


def _register_exit() -> None:
    global _exit_registered
    with _registry_lock:
        if not _exit_registered:
            # mpicoll's own exit handlers (communicators freed, MPI finalized) were
            # registered when mpicoll was imported, before this: ours runs first.
            import mpicoll.context  # noqa: F401, PLC0415

            atexit.register(_close_all_at_exit)
            _exit_registered = True


def _close_all_at_exit() -> None:
    stuck = [w for w in list(_workers) if not w.close(EXIT_STALL_SECONDS)]
    if stuck:
        from mpi4py import MPI  # noqa: PLC0415

        names = ", ".join(w.name for w in stuck)
        log.error("mpicoll: at exit, %s made no progress for %g s (an operation the other "
                  "ranks never joined); aborting the job instead of hanging in MPI_Finalize",
                  names, EXIT_STALL_SECONDS)
        MPI.COMM_WORLD.Abort(1)
