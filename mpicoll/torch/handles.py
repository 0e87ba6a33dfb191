"""Handles of asynchronous operations: Horovod's integer handles over small futures."""
from __future__ import annotations

import itertools
import threading
from typing import Any

__all__ = ["Future", "register", "lookup", "release"]


class Future:
    """The result of one submitted operation, set once by the engine thread."""

    __slots__ = ("_event", "result", "error", "extra")

    def __init__(self) -> None:
        self._event = threading.Event()
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


_ids = itertools.count(1)
_futures: dict[int, Future] = {}
_lock = threading.Lock()


def register(future: Future) -> int:
    """Return a new integer handle for ``future``."""
    with _lock:
        handle = next(_ids)
        _futures[handle] = future
    return handle


def lookup(handle: int) -> Future:
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
