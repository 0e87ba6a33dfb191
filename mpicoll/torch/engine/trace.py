"""The adapter's part of the timeline (:mod:`mpicoll.timeline`): Horovod's activities.

When a timeline is recording (``hvd.start_timeline(path)`` or ``MPICOLL_TIMELINE=path``),
each rank records, on one track per tensor name (Horovod draws one row per tensor):

- ``NEGOTIATE_<OP>``: from this rank's submission of the request until the negotiation
  round in which every rank had submitted it (how long it waited for the others);
- ``<OP>`` (``ALLREDUCE``, ``ALLGATHER``, ``BROADCAST``, ``ALLTOALL``, ``REDUCESCATTER``,
  ``BARRIER``, ``JOIN``): the execution of the bucket it ran in, and inside it the
  activities ``MEMCPY_IN_FUSION_BUFFER``, ``MPI_<OP>`` (the collective: Horovod's name for
  it on MPI, here mpicoll's algorithm, which the core also records on its communicator's
  track) and ``MEMCPY_OUT_FUSION_BUFFER``; every tensor of a fused bucket gets the
  bucket's activities, as in Horovod;
- with ``mark_cycles=True``, each negotiation round as a ``CYCLE`` event on the track
  ``cycles`` (Horovod marks the start of its background cycles).

Rounds run on one thread at a time (the engine's round lock), so the bucket being executed
is a module global (:data:`current`). Nothing here costs more than a ``None`` test or an
:func:`mpicoll.timeline.enabled` call while no timeline records.
"""
from __future__ import annotations

from typing import Any

from ... import timeline

__all__ = ["BucketTrace", "begin_bucket", "end_bucket", "step", "negotiated", "cycle",
           "submit_time", "current"]

#: The bucket being executed, while a timeline records (``None`` otherwise).
current: BucketTrace | None = None


def submit_time() -> float:
    """When a request is submitted: :func:`mpicoll.timeline.now`, or 0 while no timeline
    records (then no negotiation event is recorded for it)."""
    return timeline.now() if timeline.enabled() else 0.0


class BucketTrace:
    """The operation and activities of one executed bucket, for its tensors' tracks."""

    __slots__ = ("activities", "args", "begin", "names", "op", "open", "since")

    def __init__(self, op: str, names: list[str], args: dict | None = None) -> None:
        self.op = op.upper()
        self.names = names
        self.args = args
        self.begin = self.since = timeline.now()
        self.open: str | None = None
        self.activities: list[tuple[str, float, float]] = []

    def step(self, activity: str | None) -> None:
        """End the open activity (if any) and open ``activity`` (``None``: none)."""
        now = timeline.now()
        if self.open is not None:
            self.activities.append((self.open, self.since, now))
        self.open, self.since = activity, now

    def end(self, error: BaseException | None = None) -> None:
        """Record the operation and its activities on every tensor's track."""
        self.step(None)
        args = dict(self.args or {}, tensors=len(self.names))
        if error is not None:
            args["error"] = str(error)[:200]
        for name in self.names:
            timeline.event(self.op, self.begin, self.since, track=name, category="operation",
                           args=args)
            for activity, begin, end in self.activities:
                timeline.event(activity, begin, end, track=name, category="activity")


def begin_bucket(kind: str, names: list[str], args: dict | None = None) -> None:
    """Start tracing the execution of a bucket (if a timeline records)."""
    global current
    current = BucketTrace(kind, names, args) if timeline.enabled() else None


def end_bucket(error: BaseException | None = None) -> None:
    """Record the bucket begun by :func:`begin_bucket`."""
    global current
    if current is not None:
        current.end(error)
        current = None


def step(activity: str | None) -> None:
    """Open ``activity`` inside the bucket being executed (``None``: close the open one)."""
    if current is not None:
        current.step(activity)


def negotiated(kind: str, name: str, since: float) -> None:
    """Record ``NEGOTIATE_<KIND>`` for this rank's request ``name`` submitted at ``since``
    (0: submitted while no timeline recorded), ending now."""
    if since and timeline.enabled():
        timeline.event(f"NEGOTIATE_{kind.upper()}", since, timeline.now(), track=name,
                       category="negotiation")


def cycle(begin: float, args: dict[str, Any]) -> None:
    """Record one negotiation round that began at ``begin`` (``mark_cycles``)."""
    timeline.event("CYCLE", begin, timeline.now(), track="cycles", category="cycle",
                   args=args)
