"""How a thread waits for MPI: blocking inside MPI, or polling that gives the core up.

A blocking MPI call (``MPI_Wait``, ``MPI_Barrier``, ``MPI_Sendrecv``) in MPICH or Open MPI
polls its progress engine on the core until the call completes. On the caller's thread
that is the lowest latency, and the synchronous collectives keep it. On a communication
thread (a runtime lane, such as a torch.distributed group's) it takes a core
away from the computation the thread runs beside, and on an oversubscribed or shared
machine from the late peer the wait is for: two DDP jobs of 2 ranks sharing a 2-core
machine ran at 0.84-0.94x gloo, whose threads sleep in the kernel
(docs/results/ddp_threads.md).

A thread that :func:`sleeps` (set by the lanes, ``MPICOLL_LANE_WAIT``; not the Horovod
engine's, whose training measured 5% slower so) starts the
non-blocking form of the call and polls it with ``MPI_Test``: for :data:`SPIN_S` on the
core (a peer that is already there answers within it), then yielding the core between
polls until :data:`YIELD_S` (``sched_yield``: no cost when nothing else wants the core),
then with sleeps that double from :data:`SLEEP_MIN_S` to :data:`SLEEP_MAX_S` (the most a
long wait can overrun its end: MPI only progresses while some thread polls, so a
multi-round operation whose peers all sleep goes slowly; sleeping from the start made
DDP's 1.6 MB all-reduce at n = 4 take 10-11 ms instead of 3). Other threads call the
blocking forms, unchanged. Errors are MPI's either way (a process failure raises from the
test as from the wait).

A thread may also carry a *deadline* (:func:`set_deadline`; a runtime lane sets its
timeout around each operation it runs): a wait still polling when the deadline passes
raises :class:`Expired`, which carries the requests it leaves pending (never to be freed:
their peers may still come), as do the node window's barriers (:func:`check_deadline`).
A blocking MPI call cannot notice a deadline, so a thread that carries one :func:`polls`
even where it does not sleep (a lane with ``MPICOLL_LANE_WAIT=spin``): on the core,
without yields or sleeps, the deadline checked between tests.
"""
from __future__ import annotations

import math
import os
import threading
import time
from typing import Any, Callable, Sequence

from mpi4py import MPI

__all__ = ["Expired", "sleeps", "polls", "set_sleeps", "set_deadline", "check_deadline",
           "wait", "waitall", "barrier", "sendrecv", "send", "recv", "allgather", "SPIN_S",
           "YIELD_S", "SLEEP_MIN_S", "SLEEP_MAX_S"]

#: Seconds a sleeping wait polls without giving up the core first.
SPIN_S = 50e-6
#: Seconds from the wait's start during which it polls and yields the core between polls
#: (``sched_yield``: at once back when nothing else is runnable).
YIELD_S = 1e-3
#: Its first sleep after that (seconds); each later one doubles, up to :data:`SLEEP_MAX_S`.
SLEEP_MIN_S = 20e-6
#: Its longest sleep (seconds): the most a long wait can overrun the peer's arrival.
SLEEP_MAX_S = 200e-6

_yield = getattr(os, "sched_yield", lambda: time.sleep(0))

class Expired(BaseException):
    """A wait passed its thread's deadline (:func:`set_deadline`); ``requests``: the MPI
    requests it left pending. A ``BaseException``, so that no ``except Exception`` on the
    way mistakes it for the operation's own error; the runtime lane that set the deadline
    turns it into the operation's :class:`~mpicoll.CollectiveTimeoutError`."""

    def __init__(self, requests: Sequence[MPI.Request] = ()) -> None:
        super().__init__("the wait passed its deadline")
        self.requests = list(requests)


class _Thread(threading.local):
    sleeps = False      # class attributes: the other threads' lookups raise nothing
    deadline = math.inf


_local = _Thread()


def sleeps() -> bool:
    """Whether this thread waits for MPI by polling with sleeps."""
    return _local.sleeps


def polls() -> bool:
    """Whether this thread waits for MPI by polling (it sleeps, or carries a deadline)
    rather than blocking in MPI."""
    return _local.sleeps or _local.deadline != math.inf


def set_sleeps(on: bool) -> None:
    """Make this thread's waits for MPI poll with sleeps (``True``) or block in MPI."""
    _local.sleeps = bool(on)


def set_deadline(when: float) -> float:
    """Make this thread's waits raise :class:`Expired` once ``time.perf_counter()`` passes
    ``when`` (``math.inf``: never; until then they poll, :func:`polls`); returns the
    deadline it replaces."""
    before = _local.deadline
    _local.deadline = when
    return before


def check_deadline(requests: Sequence[MPI.Request] = ()) -> None:
    """Raise :class:`Expired` (carrying ``requests``, left pending) when this thread's
    deadline has passed."""
    if time.perf_counter() > _local.deadline:
        raise Expired(requests)


def _poll(test: Callable[[], bool], requests: Sequence[MPI.Request] = (),
          naps: bool = True) -> None:
    if test():
        return
    if not _local.sleeps:       # a deadline only: on the core
        while not test():
            check_deadline(requests)
        return
    clock = time.perf_counter
    start = clock()
    deadline = start + SPIN_S
    while clock() < deadline:
        if test():
            return
    deadline = start + YIELD_S if naps else math.inf
    while clock() < deadline:
        if test():
            return
        check_deadline(requests)
        _yield()
    pause = SLEEP_MIN_S
    while not test():
        check_deadline(requests)
        time.sleep(pause)
        pause = min(pause * 2, SLEEP_MAX_S)


def wait(request: MPI.Request, naps: bool = True) -> None:
    """``request.Wait()``. ``naps=False``: a sleeping thread polls yielding the core but
    never sleeps (for one MPI call that moves much data in many steps, each of which
    needs a poll: MPI's own gather or all-to-all of megabytes; measured in
    docs/results/ddp_threads.md, "MPI's own gather, scatter and all-to-all on a lane")."""
    if polls():
        _poll(request.Test, (request,), naps)
    else:
        request.Wait()


def waitall(requests: Sequence[MPI.Request]) -> None:
    """``MPI.Request.Waitall(requests)``."""
    if polls():
        _poll(lambda: MPI.Request.Testall(requests), requests)
    else:
        MPI.Request.Waitall(requests)


def barrier(comm: MPI.Comm) -> None:
    """``comm.Barrier()``."""
    if polls():
        wait(comm.Ibarrier())
    else:
        comm.Barrier()


def sendrecv(comm: MPI.Comm, sendbuf: Any, dest: int, sendtag: int, recvbuf: Any,
             source: int, recvtag: int) -> None:
    """``comm.Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag)``."""
    if polls():
        waitall([comm.Irecv(recvbuf, source, recvtag), comm.Isend(sendbuf, dest, sendtag)])
    else:
        comm.Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag)


def send(comm: MPI.Comm, buf: Any, dest: int, tag: int) -> None:
    """``comm.Send(buf, dest, tag)``."""
    if polls():
        wait(comm.Isend(buf, dest, tag))
    else:
        comm.Send(buf, dest, tag)


def recv(comm: MPI.Comm, buf: Any, source: int, tag: int) -> None:
    """``comm.Recv(buf, source, tag)``."""
    if polls():
        wait(comm.Irecv(buf, source, tag))
    else:
        comm.Recv(buf, source, tag)


def allgather(comm: MPI.Comm, sendbuf: Any, recvbuf: Any) -> None:
    """``comm.Allgather(sendbuf, recvbuf)``."""
    if polls():
        wait(comm.Iallgather(sendbuf, recvbuf))
    else:
        comm.Allgather(sendbuf, recvbuf)
