"""Point-to-point operations of the backend: ``send``, ``recv`` (also from any source).

Each call posts a non-blocking ``MPI_Isend``/``MPI_Irecv`` on the group's point-to-point
communicator at once, on the caller's thread, so sends and receives never wait for each
other or for the group's queued collectives (``batch_isend_irecv``'s order-free batches
work). The returned :class:`P2PWork` completes the request when waited on or tested;
``get_future()`` starts a thread that waits for it. Tags are MPI tags (0 to
``MPI_TAG_UB``, at least 32767); messages between one pair of ranks with one tag arrive
in the order they were sent.

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

from ... import faults
from .failures import GroupFailures
from .staging import Staging
from .tensors import Host, check_tensor
from .work import MPIWork, finished_with_error, seconds

__all__ = ["P2PWork", "isend", "irecv", "check_tag"]

_tag_ub: int | None = None


def check_tag(tag: int) -> int:
    """``tag`` if MPI can carry it, else ``ValueError``."""
    global _tag_ub
    if _tag_ub is None:
        _tag_ub = int(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB))
    if not 0 <= int(tag) <= _tag_ub:
        raise ValueError(f"tag {tag} is outside MPI's range 0..{_tag_ub}")
    return int(tag)


class P2PWork(MPIWork):
    """A posted send or receive."""

    def __init__(self, kind: str, request: Any, host: Host, stage: Staging,
                 tensors: list[torch.Tensor], timeout: float | None,
                 failures: GroupFailures | None = None) -> None:
        super().__init__(kind, timeout)
        self._failures = failures
        self._request = request
        self._host = host
        self._stage = stage
        self._tensors = tensors
        self._status = MPI.Status()
        self._lock = threading.Lock()
        self._waiter: threading.Thread | None = None

    def _complete(self) -> None:
        try:
            if self.kind != "send":
                self._host.finish()
                self._stage.after()
                self.source_rank = self._status.Get_source()
        except BaseException as exc:  # noqa: BLE001  (handed to the waiter)
            self.finish(None, exc)
        else:
            self.finish(self._tensors)

    def _poll(self, limit: float | None) -> bool:
        """Test the request until it completes or ``limit`` seconds pass (``0``: once)."""
        deadline = None if limit is None else time.monotonic() + limit
        pause = 0.0
        while True:
            with self._lock:
                if self._done.is_set():
                    return True
                try:
                    done = self._request.Test(self._status)
                except BaseException as exc:  # noqa: BLE001
                    self._fail(exc)
                    return True
                if done:
                    self._complete()
                    return True
                failure = self._failures.poll(self.kind) if self._failures else None
                if failure is not None:   # a rank of the group died: this may never end
                    self._fail(failure)
                    return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2 or 1e-5, 2e-3)

    def _fail(self, exc: BaseException) -> None:
        """Complete with ``exc`` (a process failure as the group's error); the request
        is kept, never freed."""
        if self._failures is not None:
            exc = self._failures.translate(self.kind, exc)
            faults.keep_requests([self._request])
        self.finish(None, exc)

    def wait(self, timeout: Any = None) -> bool:  # noqa: D102 (MPIWork's)
        limit = seconds(timeout)
        if limit is None:
            limit = self._timeout
        if not self._poll(limit):
            raise RuntimeError(f"mpicoll: {self.kind} timed out after {limit:g} s waiting for "
                               f"its peer")
        return super().wait(timeout)

    def is_completed(self) -> bool:  # noqa: D102
        return self._poll(0)

    def get_future(self) -> Any:  # noqa: D102
        with self._lock:
            if not self._done.is_set() and self._waiter is None:
                self._waiter = threading.Thread(target=self._poll, args=(None,),
                                                name=f"mpicoll-{self.kind}", daemon=True)
                self._waiter.start()
        return self._future


def isend(comm: Any, tensors: list[torch.Tensor], dst: int, tag: int,
          timeout: float | None, failures: GroupFailures | None = None) -> MPIWork:
    """Post a send of ``tensors[0]`` to group rank ``dst`` (``failures``: the group's;
    a failed group's work fails at once)."""
    tensor, stage = _one(tensors, comm, dst, "dst")
    refused = failures.refuse("send") if failures is not None else None
    if refused is not None:
        return finished_with_error("send", refused)
    host = Host(stage.host(tensor))
    stage.before()
    try:
        request = comm.Isend(host.array, dest=dst, tag=check_tag(tag))
    except MPI.Exception as exc:
        return finished_with_error("send", _posting_error(failures, "send", exc))
    return P2PWork("send", request, host, stage, tensors, timeout, failures)


def irecv(comm: Any, tensors: list[torch.Tensor], src: int, tag: int,
          timeout: float | None, failures: GroupFailures | None = None) -> MPIWork:
    """Post a receive into ``tensors[0]`` from group rank ``src`` (``MPI.ANY_SOURCE``:
    any; ``failures`` as :func:`isend`'s)."""
    kind = "recv_anysource" if src == MPI.ANY_SOURCE else "recv"
    tensor, stage = _one(tensors, comm, src, "src")
    refused = failures.refuse(kind) if failures is not None else None
    if refused is not None:
        return finished_with_error(kind, refused)
    host = Host(stage.host(tensor, load=False, store=True))
    try:
        request = comm.Irecv(host.array, source=src, tag=check_tag(tag))
    except MPI.Exception as exc:
        return finished_with_error(kind, _posting_error(failures, kind, exc))
    return P2PWork(kind, request, host, stage, tensors, timeout, failures)


def _posting_error(failures: GroupFailures | None, kind: str, exc: BaseException) -> Any:
    """The error of a send or receive that MPI refused to post: the group's process
    failure, else ``exc`` itself (raised at once)."""
    error = failures.translate(kind, exc) if failures is not None else exc
    if error is exc:
        raise exc
    return error


def _one(tensors: list[torch.Tensor], comm: Any, peer: int, argname: str) -> tuple:
    if len(tensors) != 1:
        raise ValueError(f"point-to-point operations take one tensor, not {len(tensors)}")
    if peer != MPI.ANY_SOURCE and not 0 <= peer < comm.Get_size():
        raise ValueError(f"{argname}={peer} is not a rank of the group (size "
                         f"{comm.Get_size()})")
    return check_tensor(tensors[0], "tensor"), Staging()
