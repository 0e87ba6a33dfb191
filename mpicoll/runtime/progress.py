"""Work off the caller's thread: ``lane.submit(kind, op) -> Work``.

A :class:`Lane` is one client's ordered stream of operations on its communicators (a
torch.distributed group, the Horovod engine, a parameter server's handles, an averager):
operations run in submission order on the lane's own thread, started on first use, so one
client's blocking collective never delays another client's (a single thread shared by
clients that run blocking collectives in arrival order could deadlock: rank 0 running
client A's collective while rank 1 runs client B's). A lane's thread waits for MPI
yielding the core and then sleeping once a peer is late (:mod:`mpicoll.waiting`,
``MPICOLL_LANE_WAIT``), leaving it to the computation beside it; a lane made with
``sleeps=False`` (the Horovod engine's) blocks in MPI. Below ``MPI_THREAD_MULTIPLE`` (only
one thread may call MPI), and for an operation submitted from the lane's own thread (a
callback that starts another operation), ``submit`` runs the operation inline. A caller
that would wait for its operation at once may ask for it to run on its own thread
(``submit(..., here=True)``) once the operations before it have completed: no hand-over
to the lane's thread and back, which on oversubscribed cores costs wake-ups.

A :class:`Work` is the operation's handle: ``wait(timeout)``, ``done()``, ``result()``,
``exception()`` and ``add_done_callback(fn)`` (callbacks run on the thread that
completes the work, as torch's ``Future.then`` does with gloo). An operation's error passes
through :func:`mpicoll.runtime.failures.translate` when the work completes: a process
failure reaches the client as :class:`~mpicoll.ProcessFailedError`, once.

Timeouts and abort:

- a ``wait(timeout)`` that expires raises :class:`~mpicoll.CollectiveTimeoutError` at
  once, naming the operation (and the ranks that did not arrive, where the lane's client
  can tell), and *breaks* the lane (:meth:`Lane.abort`);
- so does an operation that is still waiting for MPI when the lane's timeout has passed
  since it started, whether or not anyone waits for it (DDP's reducer waits on the
  future; gloo times its operations out the same way): its waits that sleep
  (:mod:`mpicoll.waiting`, the lanes' default, and the node window's barriers) raise at
  the deadline and the work fails with that error;
- :meth:`Lane.abort` fails the work in flight and every queued work with the error. Under
  ULFM the lane's communicators are revoked, so the MPI call in flight really ends and
  the client can be rebuilt. Without ULFM an MPI call cannot be cancelled: using a broken
  lane again, closing it, or the process's exit ends the job (``MPI_Abort``) with the
  error's message. Never a silent hang.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import queue
import sys
import threading
import time
import weakref
from typing import Any, Callable

from mpi4py import MPI

from .. import config, waiting
from ..errors import CollectiveError, CollectiveTimeoutError, ProcessFailedError
from . import exit as runtime_exit
from . import failures

__all__ = ["Work", "Lane", "inline_only", "completed", "create", "EXIT_STALL_S",
           "CREATE_GRACE_S"]

log = logging.getLogger("mpicoll.runtime")

#: At exit, how long a lane's thread may go without finishing an operation before the job
#: is aborted (an operation that other ranks never joined).
EXIT_STALL_S = 10.0
#: How long (seconds) a communicator's creation may go on once a member is known to have
#: failed (:func:`create`).
CREATE_GRACE_S = 1.0
#: How often (seconds) :func:`create` asks MPI whether a member has failed.
_CREATE_POLL_S = 0.02


def inline_only() -> bool:
    """Whether operations must run on the caller's thread (MPI below
    ``MPI_THREAD_MULTIPLE``)."""
    return MPI.Query_thread() < MPI.THREAD_MULTIPLE


class Work:
    """One operation's handle.

    Args:
        kind: the operation's name (shown in errors).
        lane: the lane it runs on (``None``: a work completed by hand).
    """

    def __init__(self, kind: str, lane: "Lane | None" = None) -> None:
        self.kind = kind
        self.lane = lane
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._result: Any = None
        self._callbacks: list[Callable[["Work"], Any]] = []

    def finish(self, result: Any = None, error: BaseException | None = None) -> bool:
        """Complete the work (once: later calls are ignored; returns whether this one
        completed it); its callbacks run here, in the order they were added."""
        with self._lock:
            if self._done.is_set():
                return False
            self._result, self._error = result, error
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            self._call(fn)
        return True

    def _call(self, fn: Callable[["Work"], Any]) -> None:
        try:
            fn(self)
        except Exception:  # noqa: BLE001  (a callback's own error is its own)
            log.exception("mpicoll: a callback of %s raised", self.kind)

    def add_done_callback(self, fn: Callable[["Work"], Any]) -> None:
        """Call ``fn(work)`` when the work completes (now, if it has)."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        self._call(fn)

    def done(self) -> bool:
        """Whether the work has completed (with a result or an error)."""
        return self._done.is_set()

    def wait_done(self, timeout: float | None) -> bool:
        """Whether the work completed within ``timeout`` seconds (``None``: forever);
        nothing is raised and the lane is left as it is."""
        return self._done.wait(timeout)

    def exception(self) -> BaseException | None:
        """The work's error (``None``: none, or not completed)."""
        return self._error

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the work completes; return its result or raise its error.

        Args:
            timeout: seconds (``None``: the lane's timeout; ``None`` there: forever).
        Raises:
            CollectiveTimeoutError: the time passed first; the lane is broken.
        """
        if timeout is None and self.lane is not None:
            timeout = self.lane.timeout
        if self.lane is not None and not self._done.is_set():
            self.lane.run_queued_until(self)    # (on the lane's own thread only)
        if not self._done.wait(timeout):
            raise self.lane.timed_out(self, timeout) if self.lane is not None else \
                CollectiveTimeoutError(f"mpicoll: {self.kind} timed out after {timeout:g} s",
                                       self.kind)
        if self._error is not None:
            raise self._error
        return self._result

    def result(self) -> Any:
        """:meth:`wait` with the lane's timeout."""
        return self.wait()


def completed(kind: str, result: Any = None, error: BaseException | None = None) -> Work:
    """A work that has already completed."""
    work = Work(kind)
    work.finish(result, error)
    return work


_lanes: "weakref.WeakSet[Lane]" = weakref.WeakSet()


class Lane:
    """One client's ordered stream of operations, run on a thread of its own.

    Args:
        name: the thread's name (and the client's, in messages).
        comm: the communicator the lane's operations run on (revoked on abort under
            ULFM; errors are translated against it). ``None``: the world.
        timeout: seconds :meth:`Work.wait` waits by default, and the longest an operation
            may wait for MPI (``None``: forever).
        missing: a callable naming the ranks that did not arrive at an operation, for
            timeout messages (``None``: not known).
        inline: run every operation on the calling thread (default: below
            ``MPI_THREAD_MULTIPLE``).
        sleeps: whether the lane's thread waits for MPI polling with yields and sleeps
            (:mod:`mpicoll.waiting`) rather than blocking in MPI, where
            ``MPICOLL_LANE_WAIT`` is ``auto`` (its default).
    """

    def __init__(self, name: str, comm: Any = None, timeout: float | None = None,
                 missing: Callable[[Work], list[int]] | None = None,
                 inline: bool | None = None, sleeps: bool = True) -> None:
        self.name = name
        self.comm = comm
        self.timeout = timeout
        self.missing = missing
        self.inline = inline_only() if inline is None else inline
        #: Whether the lane's thread waits for MPI with sleeps (:mod:`mpicoll.waiting`).
        self.sleeps = config.lane_wait_sleeps(sleeps)
        #: The error that broke the lane (``None`` while it works).
        self.broken: BaseException | None = None
        self.completed = 0
        self._progressed_at = 0.0
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._pending: list[Work] = []
        self._running: Work | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        #: notified when an operation ends (a caller waiting to run one ``here``)
        self._idle = threading.Condition(self._lock)
        #: a caller runs an operation on its own thread: the lane's thread starts none
        self._here = False
        self._closed = False
        #: an operation was left in MPI when its wait passed the lane's timeout (its
        #: requests pending: without ULFM, closing the lane or exiting ends the job)
        self.abandoned = False

    # --- submission -------------------------------------------------------------------
    def submit(self, kind: str, op: Callable[[], Any], here: bool = False) -> Work:
        """Run ``op()`` after the operations submitted before it; its return value is the
        work's result, its error (translated) the work's error. ``here``: on the calling
        thread, once the operations before it have completed (the call returns then; on
        a broken lane it is refused as on the lane).

        Raises:
            RuntimeError: the lane was closed.
        """
        if self._closed:
            raise self._shut(kind)
        work = Work(kind, self)
        if self.broken is not None:    # refused with the error that broke the lane
            if not failures.ENABLED:
                _end_job(f"{kind} on {self.name}, which is broken: {self.broken}")
            work.finish(None, self.broken)
            return work
        if self.inline or threading.current_thread() is self._thread:
            self._execute(work, op)
            return work
        if here and self._run_here(work, op):
            return work
        with self._lock:   # (close() queues its marker under the lock: never before this)
            if self._closed:
                raise self._shut(kind)
            self._pending.append(work)
            if self._thread is None:
                _register_exit()
                thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                thread.start()
                self._thread = thread
                _lanes.add(self)
            self._queue.put((work, op))
        return work

    def _shut(self, kind: str) -> RuntimeError:
        return RuntimeError(f"mpicoll: {kind} on {self.name}, which was shut down")

    def _run_here(self, work: Work, op: Callable[[], Any]) -> bool:
        """Run ``work`` on this thread once the lane is idle, the lane's thread held back
        meanwhile, waiting for MPI as the lane's thread does (the peers may run the same
        operation on their lanes: a blocking collective never matches a non-blocking
        one); ``False`` (nothing run) if the lane broke while this waited."""
        with self._lock:
            while (self._pending or self._running is not None) and self.broken is None:
                self._idle.wait()
            if self.broken is not None:
                return False
            self._here = True
            self._running = work
        sleeps = waiting.sleeps()
        waiting.set_sleeps(self.sleeps)
        try:
            self._execute(work, op)
        finally:
            waiting.set_sleeps(sleeps)
            with self._lock:
                self._here = False
                self._idle.notify_all()
        return True

    def run_queued_until(self, work: Work) -> None:
        """On the lane's own thread (a callback of a completed operation, waiting for an
        operation queued after it): run the queued operations, in submission order, until
        ``work`` has run, as the lane would run them next. Anywhere else: nothing (the
        lane's thread could never start ``work`` while it waits)."""
        if threading.current_thread() is not self._thread:
            return
        outer = self._running
        while not work.done():
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is None:                  # close(): its marker goes back, last
                self._queue.put(None)
                return
            with self._lock:
                if item[0] in self._pending:
                    self._pending.remove(item[0])
            self._execute(*item)
            with self._lock:
                self._running = outer

    def _execute(self, work: Work, op: Callable[[], Any]) -> None:
        if work.done() or self.broken is not None:    # aborted while queued; or broken
            work.finish(None, self.broken)    # (ignored if done)
            with self._lock:
                if self._running is work:
                    self._running = None
                self._idle.notify_all()
            return
        self._running = work
        timeout = self.timeout
        before = waiting.set_deadline(time.perf_counter() + timeout) if timeout else None
        try:
            result = op()
        except waiting.Expired as expired:   # a wait passed the lane's timeout
            failures.keep_requests(expired.requests)
            self.abandoned = True
            work.finish(None, self.timed_out(work, timeout))
        except BaseException as exc:  # noqa: BLE001  (handed to the waiter)
            broken = self.broken   # the lane's own revocation ended it: no process failure
            work.finish(None, broken if broken is not None else
                        failures.translate(exc, self.comm, work.kind))
        else:
            work.finish(result)
        finally:
            if before is not None:
                waiting.set_deadline(before)
            with self._lock:
                self._running = None
                self.completed += 1
                self._progressed_at = time.monotonic()
                self._idle.notify_all()

    def _loop(self) -> None:
        waiting.set_sleeps(self.sleeps)
        while True:
            item = self._queue.get()
            if item is None:
                return
            with self._lock:
                while self._here:
                    self._idle.wait()
                if item[0] in self._pending:
                    self._pending.remove(item[0])
                    self._running = item[0]
            self._execute(*item)

    # --- failure, timeout, abort ------------------------------------------------------
    def timed_out(self, work: Work, timeout: float | None) -> CollectiveTimeoutError:
        """The error of ``work`` whose wait expired; the lane is aborted with it."""
        missing: list[int] = []
        if self.missing is not None:
            with contextlib.suppress(Exception):  # (a report, not the error)
                missing = list(self.missing(work))
        who = f"; rank(s) {missing} did not arrive" if missing else ""
        error = CollectiveTimeoutError(
            f"mpicoll: {work.kind} on {self.name} timed out after {timeout:g} s{who}; "
            f"{self.name} is broken (" + ("its communicators are revoked: rebuild it)"
                                          if failures.ENABLED else
                                          "using it again ends the job)"),
            work.kind, missing)
        self.abort(error)
        return error

    def abort(self, error: BaseException) -> None:
        """Break the lane: the work in flight and every queued work fail with ``error``;
        under ULFM the lane's communicator and those made from it are revoked
        (:func:`~mpicoll.runtime.failures.revoke_only`: the world stays healthy), so the
        MPI call in flight ends. Later submissions fail with ``error`` (without ULFM: end the job)."""
        with self._lock:
            if self.broken is None:
                self.broken = error
            pending, self._pending = self._pending, []
            running = self._running
            on_thread = running is not None and not self._here
            self._idle.notify_all()
        for work in ([running] if running is not None else []) + pending:
            work.finish(None, error)
        if failures.ENABLED:
            if on_thread:     # its MPI call may outlive the revocation
                failures.leave_in_mpi(self.name, lambda: self._running is running)
            if self.comm is not None:
                failures.revoke_only(self.comm)

    def in_mpi(self) -> bool:
        """Whether an operation of the lane is in MPI: running, or abandoned by a wait
        that passed the lane's timeout."""
        return self._running is not None or self.abandoned

    def close(self, stall_s: float | None = None) -> bool:
        """Finish what is queued and stop the thread (idempotent). Returns ``False`` when
        the thread made no progress for ``stall_s`` seconds (it is left running). A broken
        lane without ULFM ends the job here (its MPI call cannot be cancelled); under ULFM
        its thread is not waited for (its work was failed and its communicators revoked:
        an MPI call that a revocation does not end is abandoned)."""
        with self._lock:     # (a submission either queued before the marker, or refused)
            self._closed = True
            thread = self._thread
            if thread is not None and thread is not threading.current_thread():
                self._queue.put(None)
        if self.broken is not None and not failures.ENABLED and self.in_mpi():
            _end_job(f"{self.name} closed while broken: {self.broken}")
        if thread is None or thread is threading.current_thread() or \
                (self.broken is not None and failures.ENABLED):
            return True
        began = time.monotonic()
        while True:
            thread.join(None if stall_s is None else min(stall_s, 0.05))
            if not thread.is_alive():
                self._thread = None
                return True
            if time.monotonic() - max(began, self._progressed_at) >= stall_s:
                return False


def create(build: Callable[[list[Any]], Any], parent: Any, members: list[int],
           name: str, timeout: float | None = None,
           hopeless: Callable[[], str | None] | None = None) -> Any:
    """``build(made)``, which makes a communicator of the ranks ``members`` of ``parent``
    (``[]``: all) and appends each communicator it makes to ``made``. Under ULFM, with
    ``members`` given, it runs on a lane of its own: Open MPI 5.0.11's
    ``MPI_Comm_create_group`` can wait forever for a member that died, and a revocation does
    not end it. When MPI knows a member to have failed and ``build`` has not ended
    :data:`CREATE_GRACE_S` seconds later, the lane is aborted (its thread left in MPI, which
    the process's exit then does not finalize under), and the communicators made so far are
    revoked. A process failure, or any error while a member is known to have failed, is
    raised as :class:`~mpicoll.ProcessFailedError` naming the failed members
    (:func:`~mpicoll.runtime.failures.creation_failure`). Without ULFM, ``build`` runs here
    and its errors pass unchanged.

    ``timeout`` (seconds; ``None``: none): with ``members`` given, a creation that has not
    ended by then (a member never called it) raises
    :class:`~mpicoll.CollectiveTimeoutError` naming the members; under ULFM the
    communicators made so far are revoked, without it the MPI call cannot be cancelled
    and the job ends, saying so, when this process exits (its lane is broken). Below
    ``MPI_THREAD_MULTIPLE`` the creation runs here, unbounded.

    ``hopeless`` (with ``members`` given, above ``MPI_THREAD_MULTIPLE``): polled while the
    creation waits; once it returns a reason, the other members will never call it: the
    creation ends as at its ``timeout``, raising :class:`~mpicoll.CollectiveError` with that
    reason.

    ``name`` names the creation in errors (``"new_group"``)."""
    made: list[Any] = []
    if not failures.ENABLED and (not members or (timeout is None and hopeless is None)
                                 or inline_only()):
        return build(made)
    try:
        if not members:        # every rank of parent: no MPI_Comm_create_group
            return build(made)
        lane = Lane(f"mpicoll-create-{name}")
        work = lane.submit(name, lambda: build(made))
        late = CollectiveTimeoutError(
            f"{name}: the communicator of ranks {list(members)} was not made within "
            f"{timeout:g} s: some of them did not call it" + (
                "" if failures.ENABLED else " (MPI cannot cancel the call: the job ends "
                "when this process exits)"), name, []) if timeout is not None else None
        ends = None if timeout is None else time.monotonic() + timeout
        deadline = None
        if not failures.ENABLED and hopeless is None and not work.wait_done(timeout):
            lane.abort(late)      # (no failure to watch for: one wait, no polling)
        while not work.done():
            time.sleep(_CREATE_POLL_S)
            reason = hopeless() if hopeless is not None else None
            if reason:
                for comm in made:
                    failures.revoke_only(comm)
                lane.abort(CollectiveError(f"{name} of ranks {list(members)}: {reason}"))
            elif ends is not None and time.monotonic() >= ends:
                for comm in made:
                    failures.revoke_only(comm)
                lane.abort(late)
            elif deadline is None:
                dead = set(members) & set(failures.failed_ranks(parent, 0.0))
                if dead:
                    deadline = time.monotonic() + CREATE_GRACE_S
            elif time.monotonic() >= deadline:
                for comm in made:
                    failures.revoke(comm)
                lane.abort(ProcessFailedError(
                    f"{name}: creation stuck on failed member(s)", sorted(dead)))
        if lane.broken is None or failures.ENABLED:   # (else its thread is in MPI: the
            lane.close()      # exit ends the job) its thread ends (one left in MPI by an
        return work.result()  # abort under ULFM stays there)
    except Exception as exc:   # a process failure, or what it left behind
        failure = failures.creation_failure(exc, parent, list(members),
                                            made[0] if made else None)
        if failure is None:
            raise
        raise failure from exc


def _end_job(message: str) -> None:
    """End the job with ``message``: an MPI call that cannot be cancelled is stuck."""
    if log.hasHandlers():     # else logging's last resort would print it a second time
        log.error("mpicoll: %s; ending the job", message)
    print(f"mpicoll: {message}; ending the job", file=sys.stderr, flush=True)
    runtime_exit.abort(1)


_exit_registered = False
_registry_lock = threading.Lock()


def _register_exit() -> None:
    global _exit_registered
    with _registry_lock:
        if not _exit_registered:
            atexit.register(_close_all_at_exit)   # runs before the runtime's own
            _exit_registered = True


def _close_all_at_exit() -> None:
    lanes = list(_lanes)
    for lane in lanes:
        if lane.broken is not None and not failures.ENABLED and lane.in_mpi():
            _end_job(f"at exit, {lane.name} is broken: {lane.broken}")
    stuck = [lane for lane in lanes if not lane.close(EXIT_STALL_S)]
    if stuck:
        names = ", ".join(lane.name for lane in stuck)
        _end_job(f"at exit, {names} made no progress for {EXIT_STALL_S:g} s (an operation "
                 f"the other ranks never joined)")
