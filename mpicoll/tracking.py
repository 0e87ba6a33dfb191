"""What each rank is doing on each communicator: the record the stall inspector reads.

Every blocking collective that runs through :func:`mpicoll.collectives.dispatch` (and its
cached calls) is wrapped by :func:`recorded` when the stall inspector
(:mod:`mpicoll.watchdog`) or the timeline (:mod:`mpicoll.timeline`) is on. The wrapper
costs a counter update and one list store per call: it numbers the call (``entered``, the
call's sequence number on this communicator, from 1), files its description under that
number in a ring of the last :data:`HISTORY` calls, runs it, and sets ``done`` (and
``raised``, when it raised). A call is in progress while ``entered > done``; the last
call this rank completed is :meth:`Tracker.completed` (not one that raised: its peers may
still wait in it). With the timeline on, it also records the call's begin and end.

A call's description (:class:`CallInfo`) holds what ranks must agree on: the collective,
count, dtype, op, root and the algorithm asked for (and what it resolved to).
"""
from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

import numpy as np

from . import timeline

__all__ = ["Tracker", "CallInfo", "recorded", "wanted", "HISTORY", "INSPECTED"]

#: Descriptions of the latest calls kept per communicator (a power of two).
HISTORY = 64
_MASK = HISTORY - 1
#: Set by :mod:`mpicoll.watchdog` once it watches a communicator of this process.
INSPECTED = False


def wanted() -> bool:
    """Whether calls are to be recorded (the stall inspector or the timeline is on)."""
    return INSPECTED or timeline.ON


class CallInfo(NamedTuple):
    """What ranks must agree on in one collective call."""

    collective: str
    count: int | None = None
    dtype: str | None = None
    op: str | None = None
    root: int | None = None
    algorithm: Any = None
    resolved: str | None = None
    nbytes: int = 0

    def describe(self) -> str:
        """``allreduce(count=1024, dtype=float32, op=sum, algorithm=auto->ring)``."""
        fields = [f"{name}={value}" for name, value in
                  (("count", self.count), ("dtype", _dtype_name(self.dtype)), ("op", self.op),
                   ("root", self.root)) if value is not None]
        if self.algorithm is not None:
            alg = str(self.algorithm)
            if self.resolved and self.resolved != alg:
                alg += f"->{self.resolved}"
            fields.append(f"algorithm={alg}")
        return f"{self.collective}({', '.join(fields)})"

    def differences(self, other: "CallInfo") -> list[str]:
        """The fields on which ``other`` differs: ``["count 1023 (here 1024)", ...]``."""
        out = []
        for name in ("collective", "count", "dtype", "op", "root", "algorithm"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine is not None and theirs is not None and mine != theirs:
                if name == "dtype":
                    mine, theirs = _dtype_name(mine), _dtype_name(theirs)
                out.append(f"{name} {theirs} (here {mine})")
        return out


def _dtype_name(code: str | None) -> str | None:
    if code is None:
        return None
    try:
        return str(np.dtype(code))
    except TypeError:
        return code


class Tracker:
    """One communicator's record on this rank (written by the calling thread only)."""

    __slots__ = ("entered", "done", "raised", "history", "name")

    def __init__(self, name: str) -> None:
        self.entered = 0
        self.done = 0
        self.raised = 0
        self.history: list[CallInfo | None] = [None] * HISTORY
        self.name = name

    def completed(self) -> int:
        """The number of the last call this rank completed: ``done``, less the last one
        if it raised (the peers may wait in it: it is what a leaving rank tells them)."""
        return self.done - (self.raised == self.done > 0)

    def info(self, seq: int) -> CallInfo | None:
        """The description of call ``seq`` if it is still in the ring."""
        if seq <= 0 or seq <= self.entered - HISTORY:
            return None
        return self.history[seq & _MASK]

    def recent(self, upto: int) -> dict[int, CallInfo]:
        """The descriptions of the calls this rank still remembers, up to ``upto``."""
        last = min(upto, self.entered)
        return {s: self.history[s & _MASK] for s in range(max(1, last - _MASK), last + 1)
                if self.history[s & _MASK] is not None}

    def begin(self, info: CallInfo) -> int:
        """Number a call that runs outside :func:`recorded` (the slow path)."""
        seq = self.entered + 1
        self.history[seq & _MASK] = info
        self.entered = seq
        return seq


def recorded(tracker: Tracker, info: CallInfo, run: Callable[..., Any]) -> Callable[..., Any]:
    """``run`` wrapped so that each call is numbered and described in ``tracker`` (and
    drawn on the timeline when one is being recorded); arguments are passed through."""
    history = tracker.history
    if not timeline.ON:
        def call(*args: Any) -> Any:
            seq = tracker.entered + 1
            history[seq & _MASK] = info
            tracker.entered = seq
            try:
                return run(*args)
            except BaseException:
                tracker.raised = seq
                raise
            finally:
                tracker.done = seq

        return call
    clock = time.perf_counter
    name, track = info.collective, tracker.name
    described = {"algorithm": info.resolved, "bytes": info.nbytes, "count": info.count,
                 "dtype": _dtype_name(info.dtype)}

    def timed(*args: Any) -> Any:
        seq = tracker.entered + 1
        history[seq & _MASK] = info
        tracker.entered = seq
        begin = clock()
        try:
            return run(*args)
        except BaseException:
            tracker.raised = seq
            raise
        finally:
            tracker.done = seq
            timeline.event(name, begin, clock(), track=track,
                           args={**described, "seq": seq})

    return timed
