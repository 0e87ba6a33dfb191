"""Point-to-point operations of the backend: ``send``, ``recv`` (also from any source).

Each call posts a non-blocking ``MPI_Isend``/``MPI_Irecv`` on the group's point-to-point
communicator at once, on the caller's thread, so sends and receives never wait for each
other or for the group's queued collectives (``batch_isend_irecv``'s order-free batches
work). The returned :class:`P2PWork` completes the request when waited on or tested;
its ``get_future()`` completes from the group's point-to-point lane, one runtime
:class:`~mpicoll.runtime.Lane` that tests every request whose future was asked for. Tags
are MPI tags (0 to ``MPI_TAG_UB``, at least 32767); messages between one pair of ranks
with one tag arrive in the order they were sent.

Under ULFM, a request that fails, or a wait during which a rank of the group is known to
have failed (even a receive from a live rank), completes with the group's
:class:`~mpicoll.ProcessFailedError` (:mod:`.failures`); the request is then never freed.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import torch
from mpi4py import MPI

from ...errors import CollectiveTimeoutError
from ...runtime import Lane, Work, failures
from .staging import Staging
from .tensors import Host, check_tensor
from .work import MPIWork, completed, seconds

__all__ = ["P2PWork", "Futures", "post", "check_tag"]

_tag_ub: int | None = None
#: dropped works still pending when their group shut down (never freed)
_ABANDONED: list[Any] = []


def check_tag(tag: int) -> int:
    """``tag`` if MPI can carry it, else ``ValueError``."""
    global _tag_ub
    if _tag_ub is None:
        _tag_ub = int(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB))
    if not 0 <= int(tag) <= _tag_ub:
        raise ValueError(f"tag {tag} is outside MPI's range 0..{_tag_ub}")
    return int(tag)


class P2PWork(MPIWork):
    """A posted send or receive of group ``pg`` (an :class:`.MPIProcessGroup`)."""

    def __init__(self, kind: str, request: Any, host: Host, stage: Staging,
                 tensors: list[torch.Tensor], pg: Any) -> None:
        super().__init__(Work(kind))
        self._pg = pg
        self._request = request
        self._host = host
        self._stage = stage
        self._tensors = tensors
        self._status = MPI.Status()
        self._lock = threading.Lock()

    def _complete(self) -> None:
        try:
            if self.kind != "send":
                self._host.finish()
                self._stage.after()
                self.source_rank = self._status.Get_source()
        except BaseException as exc:  # noqa: BLE001  (handed to the waiter)
            self.work.finish(None, exc)
        else:
            self.work.finish(self._tensors)

    def poll(self, limit: float | None) -> bool:
        """Test the request until it completes or ``limit`` seconds pass (``0``: once)."""
        deadline = None if limit is None else time.monotonic() + limit
        pause = 0.0
        while True:
            with self._lock:
                if self.work.done():
                    return True
                try:
                    done = self._request.Test(self._status)
                except BaseException as exc:  # noqa: BLE001  (revoked by an abort: its error)
                    self._fail(self._pg._lane.broken or exc)
                    return True
                if done:
                    self._complete()
                    return True
                failure = self._pg._failures.poll(self.kind) or self._pg._lane.broken
                if failure is not None:   # a rank died, or the group was aborted
                    self._fail(failure)
                    return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2 or 1e-5, 2e-3)

    def _fail(self, exc: BaseException) -> None:
        """Complete with ``exc`` (a process failure as the group's error); the request
        is kept, never freed."""
        if failures.ENABLED:
            exc = self._pg._failures.error(self.kind, exc)
            failures.keep_requests([self._request])
        self.work.finish(None, exc)

    def wait(self, timeout: Any = None) -> bool:  # noqa: D102 (MPIWork's)
        limit = seconds(timeout) or self._pg._lane.timeout
        if not self.poll(limit):
            raise CollectiveTimeoutError(f"mpicoll: {self.kind} timed out after {limit:g} s "
                                         f"waiting for its peer", self.kind)
        return super().wait()

    def is_completed(self) -> bool:  # noqa: D102
        return self.poll(0)

    def get_future(self) -> Any:  # noqa: D102
        if not self.work.done():
            self._pg._futures.watch(self)
        return self._future

    def __del__(self) -> None:
        # dropped by its caller while MPI may still use its buffer (an isend whose Work
        # was not kept): kept alive until its request completes (a plain append: this runs
        # wherever the collector does, so it takes no lock)
        try:
            if not self.work.done():
                self._pg._futures.dropped.append(self)
        except Exception:  # noqa: BLE001,S110  (interpreter shutdown: nothing left to keep)
            pass


class Futures:
    """The requests of one group whose futures were asked for, tested on the group's
    point-to-point lane until each completes."""

    def __init__(self, name: str) -> None:
        self.lane = Lane(name)
        self._works: list[P2PWork] = []
        self._lock = threading.Lock()
        #: works their callers dropped before they completed (:meth:`P2PWork.__del__`):
        #: their buffers stay alive until :meth:`prune` finds their requests complete
        self.dropped: list[P2PWork] = []

    def prune(self) -> None:
        """Let go of the dropped works whose requests have completed (at each post, so a
        dropped send's buffer lives until MPI is done with it)."""
        for work in list(self.dropped):
            if work.poll(0):
                self.dropped.remove(work)

    def close(self) -> None:
        """At the group's shutdown: the dropped works still pending are kept for the rest
        of the process (their sends or receives may yet run)."""
        self.prune()
        _ABANDONED.extend(self.dropped)
        self.dropped.clear()

    def watch(self, work: P2PWork) -> None:
        """Complete ``work`` (and so its future) as soon as its request completes."""
        with self._lock:
            running = bool(self._works)   # (_run tests them until none is left)
            if work not in self._works:
                self._works.append(work)
        if not running:
            self.lane.submit("p2p futures", self._run)

    def _run(self) -> None:
        pause = 0.0
        while True:
            with self._lock:
                works = list(self._works)
            done = [w for w in works if w.poll(0)]   # (callbacks may watch more)
            with self._lock:
                self._works = [w for w in self._works if w not in done]
                if not self._works:
                    return
            time.sleep(pause)
            pause = min(pause * 2 or 1e-5, 2e-3)


def post(pg: Any, tensors: list[torch.Tensor], peer: int, tag: int, send: bool) -> MPIWork:
    """Post a send of ``tensors[0]`` to rank ``peer`` of group ``pg`` (``send``), else a
    receive into it from rank ``peer`` (``MPI.ANY_SOURCE``: any). On a group that failed
    or is broken the work fails at once (without ULFM a broken group used again ends the
    job: the runtime's lane does it); a request that MPI refuses to post fails with the
    group's process failure, else its error is raised at once."""
    kind = "send" if send else "recv_anysource" if peer == MPI.ANY_SOURCE else "recv"
    pg._futures.prune()
    refused = pg._failures.refuse(kind)
    if refused is not None:
        return completed(kind, None, refused)
    if pg._lane.broken is not None:
        return MPIWork(pg._lane.submit(kind, lambda: None))
    if len(tensors) != 1:
        raise ValueError(f"point-to-point operations take one tensor, not {len(tensors)}")
    size = pg._p2p.Get_size()
    if peer != MPI.ANY_SOURCE and not 0 <= peer < size:
        raise ValueError(f"{'dst' if send else 'src'}={peer} is not a rank of the group "
                         f"(size {size})")
    stage = Staging()
    host = Host(stage.host(check_tensor(tensors[0], "tensor"), load=send, store=not send))
    if send:
        stage.before()
    try:
        start = pg._p2p.Isend if send else pg._p2p.Irecv
        request = start(host.array, peer, check_tag(tag))
    except MPI.Exception as exc:
        error = pg._failures.error(kind, exc)
        if error is exc:
            raise
        return completed(kind, None, error)
    return P2PWork(kind, request, host, stage, tensors, pg)
