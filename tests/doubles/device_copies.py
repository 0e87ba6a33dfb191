"""Test double: a host stand-in for the device, the staged pipeline's copies with
deferred streams.

:class:`SimulatedCopies` implements :class:`mpicoll.gpu.staging.Copies` with numpy arrays
standing in for device arrays. Copies are *queued* on their stream, as on a GPU, and run
only when something forces them: the host waiting for an event, or a stream waiting for
another stream's event when its own queue reaches that point. In the default ``lazy``
mode nothing runs earlier than it must, so a missing wait in the pipeline (the host
reading a slot before its d2h copy ran, a d2h refilling a slot whose h2d has not yet read
it) gives a wrong result instead of passing by luck; ``eager`` runs every copy at once
(like a synchronous device). Every operation is appended to :attr:`log`, so tests can
check the order of operations that gives the overlap.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from mpicoll.gpu.slots import HostSlots

__all__ = ["Event", "SimulatedCopies"]


class Event(NamedTuple):
    """A point in one simulated stream: done once its first ``position`` ops have run."""

    stream: str
    position: int
    chunk: int


class SimulatedCopies:
    """Deferred-stream simulation of the staged path's device copies (see module doc).

    Args:
        mode: ``"lazy"`` (default: run queued copies only when forced) or ``"eager"``.
        host_alloc: allocator of host slots (``numpy.empty`` of uint8 by default).
        unwrap: ``unwrap(obj) -> numpy array`` for objects standing in for device arrays
            (default: numpy arrays only).
        wrap: ``wrap(array) -> object`` making a new result look like the arguments
            (default: the numpy array itself).

    Attributes:
        log: ``(operation, stream, chunk)`` tuples in issue order: ``("begin", "", -1)``,
            ``("d2h", "d2h", k)``, ``("h2d", "h2d", k)``, ``("record", stream, k)``,
            ``("wait", stream, k)`` (the host blocks), ``("stream_wait", stream, k)``
            (``stream`` waits for chunk k's event of the other stream), ``("finish",
            "h2d", k)``, ``("drain", "", -1)``; plus whatever the test appends (its host
            calls).
        host_pool: the host slots.
    """

    def __init__(self, mode: str = "lazy",
                 host_alloc: Callable[[int], np.ndarray] | None = None,
                 unwrap: Callable[[Any], np.ndarray] | None = None,
                 wrap: Callable[[np.ndarray], Any] | None = None) -> None:
        if mode not in ("lazy", "eager"):
            raise ValueError(f"mode must be 'lazy' or 'eager', not {mode!r}")
        self.mode = mode
        self._unwrap, self._wrap = unwrap, wrap
        self.log: list[tuple[str, str, int]] = []
        self.host_pool = HostSlots(host_alloc or (lambda n: np.empty(n, np.uint8)))
        self._queues: dict[str, list[Callable[[], None]]] = {"d2h": [], "h2d": []}
        self._ran: dict[str, int] = {"d2h": 0, "h2d": 0}
        self.copied_bytes = {"d2h": 0, "h2d": 0}

    # arrays --------------------------------------------------------------------------
    def as_array(self, obj: Any) -> np.ndarray:
        """The numpy array standing in for a device array (no copy)."""
        if self._unwrap is not None and not isinstance(obj, np.ndarray):
            obj = self._unwrap(obj)
        if not isinstance(obj, np.ndarray):
            raise TypeError(f"SimulatedCopies handles numpy arrays, not {type(obj).__name__}")
        return obj

    def wrap(self, array: np.ndarray) -> Any:
        """``array`` as a device argument (what ``wrap`` makes of it)."""
        return array if self._wrap is None else self._wrap(array)

    _new = wrap

    def empty_like(self, obj: Any) -> Any:
        """A new array like ``obj`` (same shape, dtype and memory order)."""
        return self._new(np.empty_like(self.as_array(obj)))

    def empty(self, shape: tuple, dtype: Any, like: Any) -> Any:
        """A new C-ordered array."""
        return self._new(np.empty(shape, dtype=dtype))

    # streams -------------------------------------------------------------------------
    def _flush(self, stream: str, upto: int) -> None:
        queue = self._queues[stream]
        while self._ran[stream] < upto:
            op = queue[self._ran[stream]]
            self._ran[stream] += 1
            op()

    def _enqueue(self, stream: str, op: Callable[[], None]) -> None:
        self._queues[stream].append(op)
        if self.mode == "eager":
            self._flush(stream, len(self._queues[stream]))

    def begin(self, objs: Sequence[Any]) -> None:
        """Nothing to wait for on the host (logged)."""
        self.log.append(("begin", "", -1))

    def d2h(self, dst: np.ndarray, src: np.ndarray, chunk: int) -> None:
        """Queue ``dst[...] = src`` on the d2h stream (reads ``src`` when it runs)."""
        self._copy("d2h", dst, src, chunk)

    def h2d(self, dst: np.ndarray, src: np.ndarray, chunk: int) -> None:
        """Queue ``dst[...] = src`` on the h2d stream."""
        self._copy("h2d", dst, src, chunk)

    def _copy(self, stream: str, dst: np.ndarray, src: np.ndarray, chunk: int) -> None:
        """Check, log and queue one chunk's copy on ``stream`` (``"d2h"`` or ``"h2d"``)."""
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise AssertionError(f"{stream} of chunk {chunk}: {src.shape} {src.dtype} into "
                                 f"{dst.shape} {dst.dtype}")
        self.log.append((stream, stream, chunk))
        self.copied_bytes[stream] += dst.nbytes
        self._enqueue(stream, lambda: np.copyto(dst, src))

    def record(self, stream: str, chunk: int) -> Event:
        """An event at the current end of ``stream``'s queue."""
        self.log.append(("record", stream, chunk))
        return Event(stream, len(self._queues[stream]), chunk)

    def wait(self, event: Event) -> None:
        """The host blocks: run ``event``'s stream up to it."""
        self.log.append(("wait", event.stream, event.chunk))
        self._flush(event.stream, event.position)

    def stream_wait(self, stream: str, event: Event) -> None:
        """Queue, on ``stream``, a wait for ``event`` (runs the other stream up to it)."""
        self.log.append(("stream_wait", stream, event.chunk))
        self._enqueue(stream, lambda: self._flush(event.stream, event.position))

    def finish(self, event: Event) -> None:
        """The host blocks until ``event`` (the last h2d) has run."""
        self.log.append(("finish", event.stream, event.chunk))
        self._flush(event.stream, event.position)

    def drain(self) -> None:
        """Run everything still queued."""
        self.log.append(("drain", "", -1))
        for stream in self._queues:
            self._flush(stream, len(self._queues[stream]))

    def pending(self) -> int:
        """Copies and waits queued but not yet run, over both streams."""
        return sum(len(q) - self._ran[s] for s, q in self._queues.items())
