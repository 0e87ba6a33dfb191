"""Handles of asynchronous operations: Horovod's integer handles over small futures."""
from __future__ import annotations

import itertools
import threading
from typing import Any

__all__ = ["Future", "GroupFuture", "register", "lookup", "release"]


class Future:
    """The result of one submitted operation, set once by the engine thread."""

    __slots__ = ("_event", "extra", "error", "owner", "result")

    def __init__(self, owner: Any = None) -> None:
        self._event = threading.Event()
        #: The engine that runs it (waiting and polling go through it).
        self.owner = owner
        self.result: Any = None
        self.error: BaseException | None = None
        #: Side results (the per-rank first dimensions of an all-gather).
        self.extra: Any = None

    def done(self) -> bool:
        """Whether the result (or error) is set."""
        return self._event.is_set()

    def set_result(self, result: Any, extra: Any = None) -> None:
        self.result, self.extra = result, extra
        self._event.set()

    def set_error(self, error: BaseException) -> None:
        self.error = error
        self._event.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done (or ``timeout`` seconds); return :meth:`done`."""
        return self._event.wait(timeout)


class GroupFuture:
    """The futures of a grouped operation as one: done when all are; the result is the
    list of their results, the error the first member's."""

    __slots__ = ("members",)

    def __init__(self, members: list[Future]) -> None:
        self.members = members

    def done(self) -> bool:
        """Whether every member is done."""
        return all(f.done() for f in self.members)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every member is done (or ``timeout`` seconds); return :meth:`done`."""
        return all(future.wait(timeout) for future in self.members)

    @property
    def owner(self) -> Any:
        """The engine of the members."""
        return self.members[0].owner if self.members else None

    @property
    def error(self) -> BaseException | None:
        """The first member's error, if any."""
        return next((f.error for f in self.members if f.error is not None), None)

    @property
    def result(self) -> list[Any]:
        """The members' results, in order."""
        return [f.result for f in self.members]

    @property
    def extra(self) -> list[Any]:
        """The members' side results, in order."""
        return [f.extra for f in self.members]


_ids = itertools.count(1)
_futures: dict[int, Future] = {}
#: what :func:`value` gives instead of the future's result (an in-place operation's own
#: tensor, as Horovod's ``synchronize`` returns it)
_returns: dict[int, Any] = {}
_issued = 0
_lock = threading.Lock()


def register(future: Future | GroupFuture, returns: Any = None) -> int:
    """Return a new integer handle for ``future`` (``returns``: what :func:`value` gives
    for it, else the future's result)."""
    global _issued
    with _lock:
        handle = _issued = next(_ids)
        _futures[handle] = future
        if returns is not None:
            _returns[handle] = returns
    return handle


def value(handle: int, future: Future | GroupFuture) -> Any:
    """The result :func:`~mpicoll.torch.synchronize` returns for ``handle``."""
    return _returns.get(handle, future.result)


def released(handle: Any) -> bool:
    """Whether ``handle`` was issued and has been released (synchronized)."""
    with _lock:
        return isinstance(handle, int) and 0 < handle <= _issued and handle not in _futures


def lookup(handle: int) -> Future | GroupFuture:
    """The future of ``handle``.

    Raises:
        ValueError: unknown handle (never issued, or already synchronized).
    """
    with _lock:
        future = _futures.get(handle)
    if future is None:
        raise ValueError(f"unknown handle {handle!r} (already synchronized, or never issued)")
    return future


def release(handle: int) -> None:
    """Forget ``handle`` (after :func:`synchronize`)."""
    with _lock:
        _futures.pop(handle, None)
        _returns.pop(handle, None)
