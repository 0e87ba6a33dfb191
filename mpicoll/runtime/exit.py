"""The process's exit: the runtime's last exit handler. Under ULFM it never waits forever
for a dead rank.

This module's exit handler is registered with :mod:`atexit` when the runtime is imported,
so it runs after mpicoll's other exit handlers (registered later, by the clients: they
free what they hold). It frees the communicators still alive
(:func:`mpicoll.runtime.comms.release_all`); without ULFM that is all, and mpi4py then
finalizes MPI (a failure ends the job, as MPI does).

Under ULFM (:data:`~mpicoll.runtime.failures.ENABLED`) Open MPI 5.0.11's ``MPI_Finalize``,
which waits for every rank of the job (a PMIx fence), can wait forever for one that died
(seen in jobs whose rank 0 had died, and in jobs whose ranks died while the others were
finalizing). There the handler

1. *meets*: before freeing, waits until every live rank of the current world has reached
   it too (a nonblocking barrier, polled together with MPI's failure detector). A late
   rank is waited for, as ``MPI_Finalize`` would; a rank that died before or meanwhile
   ends the wait on every survivor at once;
2. *finalizes*: ``MPI_Finalize`` on a thread of its own, waited for at most
   :data:`FINALIZE_WAIT_S` seconds (every live rank is at its exit by then); past that
   the process ends without it. Not while a thread of an aborted client is still in an
   MPI call (:data:`LEFT_WAIT_S`): finalizing under it is erroneous (it crashed Open
   MPI's progress loop on that thread), so the process ends without finalizing;
3. keeps the *status*: the interpreter ends as usual, with the program's own status, and
   mpi4py does not finalize again. Two exceptions, where the process ends at once
   (``os._exit``, after flushing): a rank of the world lost during the exit (a failure the
   program never heard of, or a finalize that never returned in a job without a failure)
   ends it with :data:`LOST_RANK_STATUS`, so that the job's status says a rank failed
   (``prterun`` reports 0 for a rank killed under ULFM); a finalize that never returned
   after a failure the program saw ends it with 1 after an uncaught exception, else 0 (a
   ``SystemExit(n)`` cannot be seen from an exit handler without patching the interpreter);
   a thread left in MPI ends it the same way.

Nothing in the interpreter is patched. Under ULFM, exit handlers registered before mpicoll
was imported run after MPI is finalized (and not at all when the process ends at once),
and every rank of the world must import mpicoll (a rank that never reaches this handler is
waited for, as by ``MPI_Finalize``).
"""
from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import os
import signal
import stat
import struct
import sys
import termios
import threading
import time

from mpi4py import MPI

from . import comms, failures, world

__all__ = ["ABORT_WAIT_S", "abort", "FORWARD_WAIT_S", "forwarded", "FINALIZE_WAIT_S",
           "LEFT_WAIT_S", "LOST_RANK_STATUS", "finalize_bounded", "failure_seen", "meet",
           "flush"]

#: Longest wait, in seconds, for ``MPI_Finalize`` at exit under ULFM (after the meeting).
FINALIZE_WAIT_S = 5.0
#: Longest wait, in seconds, at exit under ULFM for the threads of aborted clients to
#: leave the MPI calls they were in (:func:`~mpicoll.runtime.failures.left_in_mpi`).
LEFT_WAIT_S = 1.0
#: The status of a process whose world lost a rank while it was exiting.
LOST_RANK_STATUS = 1


#: Under ULFM, how long a rank whose program raised waits at exit for the others to reach
#: theirs before it ends as a failed process (they may be waiting for it: a parameter
#: server's workers for their server).
RAISED_MEET_WAIT_S = 10.0
#: :func:`meet`'s answer when its ``wait_s`` passed.
LATE: list[int] = [-2]


def failure_seen() -> bool:
    """Whether this process has seen a process failure (in any world generation)."""
    return any(world.failed(g) for g in range(world.generation() + 1))


def _status() -> int:
    return 1 if getattr(sys, "last_value", None) is not None else 0


def flush() -> None:
    """Shut logging down and flush stdout and stderr (before the process ends at once)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # (closed: nothing to flush)
            stream.flush()


def _end(status: int, message: str) -> None:
    print(f"mpicoll: {message}; ending with status {status}", file=sys.stderr)
    flush()
    os._exit(status)


#: The longest ``MPI_Abort`` may take to end this process before the kernel does (seconds).
ABORT_WAIT_S = 10
#: The longest :func:`abort` waits for the launcher to read what this process wrote.
FORWARD_WAIT_S = 2.0


def _unread(fd: int) -> int:
    """Bytes written to ``fd`` and not yet read by the other end, where ``fd`` is a pipe
    (as the launchers give a rank's stdout and stderr); 0 for anything else."""
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return 0
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
    except (OSError, ValueError):
        return 0


def forwarded(wait_s: float | None = None) -> bool:
    """Flush, then wait (at most ``wait_s`` seconds, :data:`FORWARD_WAIT_S`) until the
    launcher has read everything this process wrote to stdout and stderr. ``MPI_Abort``
    tells the launcher to end the job, and a launcher that ends it before reading the
    rank's pipes loses the message that says why (seen in CI on a busy machine: the job
    failed with no word from the aborting rank, neither mpicoll's nor MPICH's)."""
    flush()
    deadline = time.monotonic() + (FORWARD_WAIT_S if wait_s is None else wait_s)
    while any(_unread(fd) for fd in (1, 2)):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def abort(status: int = 1) -> None:
    """End the job: ``MPI_Abort`` on the runtime's world (a grown one spans the processes
    a growth spawned, which ``MPI.COMM_WORLD`` does not), bounded, once the launcher has
    what this process wrote (:func:`forwarded`). An alarm (``SIGALRM``, whose default action ends
    the process in the kernel, without the interpreter) ends this process after
    :data:`ABORT_WAIT_S` should ``MPI_Abort`` neither return nor end it: in one CI run a
    rank whose stall inspector had called it (its message was in the job's output, and the
    launcher had ended) was found alive 20 minutes later, its main thread spinning in a
    blocking ``MPI_Allreduce``. Should ``MPI_Abort`` return (MPICH 5's returns at once
    while another thread of the process polls a request with ``MPI_Test``, as mpicoll's
    lanes wait; its launcher ends the job about a second later), the process ends here
    with ``status`` (``os._exit``): nothing after the abort runs, and the launcher sees a
    rank gone without finalizing."""
    forwarded()
    if failures.ENABLED:
        _end_under_ulfm()
    if hasattr(signal, "alarm"):
        signal.alarm(ABORT_WAIT_S)
    if world.generation():       # (a reconfigured world: MPI.COMM_WORLD's abort below)
        with contextlib.suppress(Exception):
            world.comm().Abort(status)
    MPI.COMM_WORLD.Abort(status)
    os._exit(status)


def _end_under_ulfm() -> None:
    """:func:`abort` under ULFM: Open MPI 5.0.11's ``MPI_Abort`` with ``--with-ft ulfm``
    ends this process only, and a peer that polls MPI (a parameter server's serving loop,
    a lane) goes on as if nothing happened. So every communicator of the world is revoked
    (the peers' MPI calls on them end, also those waiting for a third rank) and this
    process ends by ``SIGKILL``: a process failure every peer's runtime sees
    (``ProcessFailedError``: the job ends, or elastic mode and replicas go on without it)."""
    with contextlib.suppress(Exception):
        failures.revoke(None)
    os.kill(os.getpid(), signal.SIGKILL)


def _mpi_finalize() -> None:
    """``MPI_Finalize`` through ctypes, which lets other threads run meanwhile (mpi4py's
    ``MPI.Finalize`` holds the interpreter lock)."""
    import ctypes  # noqa: PLC0415

    ctypes.CDLL(MPI.__file__).MPI_Finalize()


def _finalized() -> bool:
    try:
        return bool(MPI.Is_finalized())
    except Exception:  # noqa: BLE001
        return False


def finalize_bounded(wait_s: float | None = None) -> bool:
    """Finalize MPI on a thread, waiting at most ``wait_s`` seconds
    (:data:`FINALIZE_WAIT_S`). Returns whether MPI is finalized (or finalizing, as MPI
    says) by then."""
    if _finalized() or not MPI.Is_initialized():
        return True
    flush()
    finalizer = threading.Thread(target=_mpi_finalize, name="mpicoll-finalize", daemon=True)
    finalizer.start()
    finalizer.join(FINALIZE_WAIT_S if wait_s is None else wait_s)
    return not finalizer.is_alive() or _finalized()


def meet(comm: MPI.Intracomm, wait_s: float | None = None) -> list[int] | None:
    """Wait until every live rank of ``comm`` calls this too (a barrier that a dead rank
    ends): ``[]`` once they all have, the failed ranks when some failed, ``None`` when
    ``comm`` was revoked and MPI names no failed rank (a broken lane revokes its world:
    no meeting is possible). ``wait_s``: at most that long, then :data:`LATE`."""
    request = None
    pause = 0.0005
    ends = None if wait_s is None else time.monotonic() + wait_s
    try:
        request = comm.Ibarrier()
        while not request.Test():
            lost = failures.failed_ranks(comm, 0.0)
            if lost:
                failures.keep_requests([request])
                return lost
            if ends is not None and time.monotonic() >= ends:
                failures.keep_requests([request])
                return LATE
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
        return []
    except MPI.Exception:
        if request is not None:
            failures.keep_requests([request])
        return failures.failed_ranks(comm, failures.FAILED_WAIT_S) or None


def _at_exit() -> None:
    if _finalized():
        return
    if not failures.ENABLED:
        comms.release_all()
        return
    current = world.current()
    met: list[int] | None = None       # the program saw a failure: its status stands
    if current.failed_at_exit:         # an exit handler saw it: ask MPI for the ranks
        met = failures.failed_ranks(current.communicator, failures.FAILED_WAIT_S) or [-1]
    elif not world.failed(current.generation):
        met = meet(current.communicator, RAISED_MEET_WAIT_S if _status() else None)
        if met is LATE:    # the others may wait for this rank, which raised: they are told
            print(f"mpicoll: this rank raised and the others did not reach their exit "
                  f"within {RAISED_MEET_WAIT_S:g} s (they may wait for it): it ends as a "
                  f"failed process", file=sys.stderr)
            flush()
            _end_under_ulfm()
    comms.release_all()
    seen = failure_seen()
    left = failures.left_in_mpi(LEFT_WAIT_S)
    if left:
        _end(LOST_RANK_STATUS if met else _status(),
             f"MPI_Finalize skipped: thread(s) {', '.join(left)} still in an MPI call that "
             f"a process failure left unfinished")
    done = finalize_bounded()
    if met:
        who = "a rank" if met == [-1] else f"rank(s) {met}"
        _end(LOST_RANK_STATUS, f"{who} of the world failed while this process was exiting "
                               f"(or earlier, handled by the program: a parameter server's "
                               f"failover)")
    if not done:   # after a meeting and no failure: a rank died meanwhile
        _end(LOST_RANK_STATUS if met == [] and not seen else _status(),
             f"MPI_Finalize did not return within {FINALIZE_WAIT_S:g} s")


atexit.register(_at_exit)
