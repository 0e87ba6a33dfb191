"""Learning, inside a running job, that capacity was added (Horovod's host discovery).

Horovod's driver runs a host discovery script now and then and, when it reports more
slots, tells the workers; their next ``state.commit()`` (or ``state.check_host_updates()``)
raises :class:`~mpicoll.HostsUpdatedInterrupt` on every one of them, and the job grows.
Here there is no driver: rank 0 of the current world polls the discovery source off the
training thread (on a runtime lane, at most once every ``interval`` seconds, so a slow
script never stalls training), and every check is one small broadcast from rank 0, so
that all ranks learn the same answer at the same commit:

- nothing new: the commit returns;
- more slots than ranks, up to ``max_np``: every rank raises :class:`HostsAddedInterrupt`
  (a :class:`~mpicoll.HostsUpdatedInterrupt`), and :func:`mpicoll.elastic.run` grows the
  world (:mod:`mpicoll.elastic.grow`);
- the source failed: every rank raises :class:`DiscoveryError` (at the first poll, made when
  :func:`mpicoll.elastic.run` starts, as Horovod fails at once when its first discovery
  fails; later, after :data:`MAX_FAILED_POLLS` failed polls in a row: a failed poll in
  between only logs a warning and keeps the last answer).

Fewer slots than ranks is not acted on: only a failure shrinks the job. A target that
could not be reached is not tried again until the source's answer changes, except one the
ranks refused (a parameter server open, say: :data:`mpicoll.elastic.grow.refusers`):
then a check asks every rank (one small all-reduce) whether it still refuses, after
``interval`` seconds, then twice as long each time (at most :data:`MAX_ASK_S`), and grows
once none does.

A source is a command (a horovodrun ``--host-discovery-script``: one ``hostname`` or
``hostname:slots`` a line, run without a shell) or a callable returning the slots (an
``int``), or such lines (a ``str``, or an iterable of ``str``). Configured by
:func:`mpicoll.elastic.run`'s ``discovery=``, ``max_np=`` and ``discovery_interval=``, or by
the environment: ``MPICOLL_ELASTIC_DISCOVERY`` (a command) and ``MPICOLL_ELASTIC_MAX_NP``.
Every rank must be given the same configuration (the checks are collective when one is
set). Without a source, a check does nothing and costs nothing.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Union

import numpy as np
from .. import context
from ..errors import HostsUpdatedInterrupt
from ..runtime import progress
from . import grow
from .grow import launch_size
from .launch_hosts import DiscoveryError, parse_hosts, run_discovery_script, total_slots

__all__ = ["HostsAddedInterrupt", "DiscoveryError", "Discovery", "configure", "activate",
           "deactivate", "active", "check_host_updates", "ENV_DISCOVERY", "ENV_MAX_NP",
           "DEFAULT_INTERVAL_S", "MAX_FAILED_POLLS", "Source"]

log = logging.getLogger("mpicoll.elastic")

#: Environment variable: the discovery command, when ``run`` is given none.
ENV_DISCOVERY = "MPICOLL_ELASTIC_DISCOVERY"
#: Environment variable: the most ranks to grow to, when ``run`` is given no ``max_np``.
ENV_MAX_NP = "MPICOLL_ELASTIC_MAX_NP"
#: Seconds between two polls of the source on rank 0 (Horovod's driver: 1 s).
DEFAULT_INTERVAL_S = 1.0
#: Failed polls in a row, after the first successful one, that end the job.
MAX_FAILED_POLLS = 3
#: The most seconds between two questions to ranks that refused a growth (each asks
#: every refuser, which may walk the garbage collector's objects).
MAX_ASK_S = 60.0

Source = Union[str, Callable[[], Union[int, str, Iterable[str]]]]

# what rank 0 broadcasts at a check: [kind, value] (_ASK: grow to value if no rank refuses)
_NOTHING, _GROW, _ERROR, _ASK = 0, 1, 2, 3


class HostsAddedInterrupt(HostsUpdatedInterrupt):
    """Raised by a commit on every rank when discovery found room for more ranks: the
    state is not rolled back, and :func:`mpicoll.elastic.run` grows the world to
    ``new_size`` ranks, then synchronises the state (new ranks need it).

    Attributes:
        old_size, new_size: the world's size now and after growing.
        detected_at: when (``time.time()``) rank 0's poll saw the new slots.
    """

    def __init__(self, old_size: int, new_size: int, detected_at: float = 0.0) -> None:
        super().__init__(skip_sync=False)
        self.args = (f"hosts added: the job grows from {old_size} to {new_size} ranks",)
        self.old_size, self.new_size, self.detected_at = old_size, new_size, detected_at


def _slots_from(answer: Any, default_slots: int, name: str) -> int:
    """The total slots a callable source returned (an int, or hostname[:slots] lines)."""
    if isinstance(answer, bool) or answer is None:
        raise DiscoveryError(f"{name} returned {answer!r}, not a number of slots or "
                             f"'hostname[:slots]' lines")
    if isinstance(answer, (int, np.integer)):
        if answer < 0:
            raise DiscoveryError(f"{name} returned {answer} slots")
        return int(answer)
    if isinstance(answer, str):
        text = answer
    else:
        try:
            text = "\n".join(answer)
        except TypeError as exc:
            raise DiscoveryError(f"{name} returned a {type(answer).__name__}, not a number "
                                 f"of slots or 'hostname[:slots]' lines") from exc
    return total_slots(parse_hosts(text, default_slots, source=name))


class Discovery:
    """A discovery source and the poller of rank 0.

    Args:
        source: a command, or a callable (see the module's docstring).
        max_np: the most ranks to grow to (``None``: the size the job was launched with,
            Horovod's default).
        interval: seconds between polls.
        default_slots: slots of a host printed without a count.
    Raises:
        ValueError, TypeError: a bad argument.
    """

    def __init__(self, source: Source, max_np: int | None = None,
                 interval: float = DEFAULT_INTERVAL_S, default_slots: int = 1) -> None:
        if isinstance(source, str):
            if not source.strip():
                raise ValueError("discovery must be a command or a callable, not an empty "
                                 "string")
        elif not callable(source):
            raise TypeError(f"discovery must be a command (str) or a callable, not "
                            f"{type(source).__name__}")
        if max_np is not None and (not isinstance(max_np, int) or max_np < 1):
            raise ValueError(f"max_np must be an int of at least 1, not {max_np!r}")
        if not isinstance(interval, (int, float)) or interval < 0:
            raise ValueError(f"discovery_interval must be seconds >= 0, not {interval!r}")
        self.source, self.max_np, self.interval = source, max_np, float(interval)
        self.default_slots = default_slots
        self.name = (f"host discovery script {source!r}" if isinstance(source, str)
                     else f"discovery callable {getattr(source, '__name__', source)!r}")
        #: The size the job was launched with (``max_np``'s default).
        self.launch_size = launch_size()
        #: A target that could not be reached (spawning failed, the growth was refused,
        #: the new processes failed before a commit): not tried again until discovery's
        #: answer changes or, refused, no rank refuses any more (:meth:`refuse`; the
        #: answer then, ``None``: unknown, the target's change).
        self.failed_target = 0
        self.failed_slots: int | None = None
        #: When the ranks last refused ``failed_target`` (``None``: it was not refused),
        #: and the seconds until they are asked again (doubling, to :data:`MAX_ASK_S`).
        self.refused_at: float | None = None
        self.ask_after = self.interval
        self._poll = _PollState()
        self._lane: progress.Lane | None = None
        self._stop = threading.Event()

    def poll(self) -> int:
        """Run the source once; the slots it reports.

        Raises:
            DiscoveryError: it failed, timed out or answered nonsense.
        """
        if isinstance(self.source, str):
            return total_slots(run_discovery_script(self.source, self.default_slots))
        try:
            answer = self.source()
        except DiscoveryError:
            raise
        except Exception as exc:  # noqa: BLE001  (the user's callable: any failure)
            raise DiscoveryError(f"{self.name} raised {type(exc).__name__}: {exc}") from exc
        return _slots_from(answer, self.default_slots, self.name)

    def limit(self) -> int:
        """The most ranks the job may grow to."""
        return self.max_np if self.max_np is not None else self.launch_size

    # ----- rank 0's poller -------------------------------------------------------------
    def poll_now(self) -> None:
        """Poll once, in this thread, and record the answer (the first poll)."""
        self._poll.record(self._poll_or_error())

    def start(self) -> None:
        """Start polling every ``interval`` seconds, off the training thread (on a
        runtime lane of its own; idempotent)."""
        if self._lane is not None:
            return
        stop = self._stop = threading.Event()
        self._lane = progress.Lane("mpicoll-elastic-discovery", inline=False)
        self._lane.submit("discovery polls", lambda: self._loop(stop))

    def stop(self) -> None:
        """Stop the poller (it ends after its current poll; this does not wait)."""
        self._stop.set()
        if self._lane is not None:
            self._lane.close(0)
        self._lane = None

    def _poll_or_error(self) -> int | DiscoveryError:
        try:
            return self.poll()
        except DiscoveryError as exc:
            return exc

    def _loop(self, stop: threading.Event) -> None:
        while not stop.wait(self.interval if self.interval > 0 else 0.01):
            answer = self._poll_or_error()
            if stop.is_set():
                return
            self._poll.record(answer)
            if isinstance(answer, DiscoveryError):
                log.warning("%s failed (%d in a row): %s", self.name,
                            self._poll.failures, answer)

    def refuse(self, target: int, refused: bool = False) -> None:
        """Growing to ``target`` failed: not again until discovery's answer changes or,
        when the ranks ``refused`` it, until none does (asked every ``interval``)."""
        self.failed_target, self.failed_slots = target, self._poll.latest()[0]
        self.refused_at = time.monotonic() if refused else None
        self.ask_after = self.interval

    def forget_failure(self) -> None:
        """Try every target again (discovery's answer changed, or no rank refuses)."""
        self.failed_target, self.failed_slots, self.refused_at = 0, None, None

    def verdict(self, size: int, first: bool = False) -> tuple[int, int, str, float]:
        """Rank 0: what the latest poll means for a world of ``size`` ranks: ``(kind,
        new size, error message, when the slots were seen)``."""
        slots, failures, error, seen_at = self._poll.latest()
        if error and (first or failures >= MAX_FAILED_POLLS):
            how = "" if first else f" ({failures} polls in a row)"
            return _ERROR, 0, f"{self.name} failed{how}: {error}", 0.0
        if slots is not None and not first:    # the first check only validates the source
            target = min(self.limit(), slots)
            if target != self.failed_target or self.failed_slots not in (None, slots):
                self.forget_failure()
                if target > size:
                    return _GROW, target, "", seen_at
            elif self.refused_at is not None and target > size and \
                    time.monotonic() - self.refused_at >= self.ask_after:
                self.refused_at = time.monotonic()
                self.ask_after = min(2 * self.ask_after, MAX_ASK_S)
                return _ASK, target, "", seen_at
        return _NOTHING, 0, "", 0.0


@dataclass
class _PollState:
    """The latest answer of the source (written by the poller, read by checks)."""

    slots: int | None = None
    failures: int = 0
    error: str = ""
    seen_at: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, answer: int | DiscoveryError) -> None:
        with self.lock:
            if isinstance(answer, DiscoveryError):
                self.failures += 1
                self.error = str(answer)
            else:
                if answer != self.slots:
                    self.seen_at = time.time()
                self.slots, self.failures, self.error = answer, 0, ""

    def latest(self) -> tuple[int | None, int, str, float]:
        with self.lock:
            return self.slots, self.failures, self.error, self.seen_at


#: The discovery of the elastic function running now (``None``: none).
_active: Discovery | None = None


def configure(discovery: Source | None = None, max_np: int | None = None,
              interval: float = DEFAULT_INTERVAL_S) -> Discovery | None:
    """The :class:`Discovery` that ``run``'s arguments (or, without them, the
    environment) ask for; ``None`` without a source.

    Raises:
        ValueError: a bad argument or environment variable.
    """
    if discovery is None:
        discovery = os.environ.get(ENV_DISCOVERY, "").strip() or None
    raw = os.environ.get(ENV_MAX_NP, "").strip()
    if max_np is None and raw:
        try:
            max_np = int(raw)
        except ValueError:
            raise ValueError(f"{ENV_MAX_NP}={raw!r} is not an integer") from None
    return None if discovery is None else Discovery(discovery, max_np=max_np, interval=interval)


def activate(discovery: Discovery | None, first: bool) -> None:
    """Make ``discovery`` the one checked at commits (collective over the world when
    ``first``: rank 0 polls once, here, and a failure raises :class:`DiscoveryError` on
    every rank; ``first`` is false on ranks joining a running job, which skip that
    step as the running ranks do)."""
    global _active
    _active = discovery
    if discovery is None:
        return
    if first:     # rank 0's _agree starts its poller (a joining rank is never rank 0)
        if context.world().Get_rank() == 0:
            discovery.poll_now()
        _agree(discovery, first=True)


def deactivate() -> None:
    """No discovery any more (the elastic function returned); stops the poller."""
    global _active
    if _active is not None:
        _active.stop()
    _active = None


def active() -> Discovery | None:
    """The discovery checked at commits now (``None``: none)."""
    return _active


def check_host_updates() -> None:
    """``State.check_host_updates()``: collective over the world when a discovery is
    active (one broadcast of 16 bytes from rank 0); nothing otherwise.

    Raises:
        HostsAddedInterrupt: on every rank, when the world is to grow.
        DiscoveryError: on every rank, when discovery failed.
    """
    if _active is not None:
        _agree(_active, first=False)


def _agree(discovery: Discovery, first: bool) -> None:
    from .. import collectives  # noqa: PLC0415  (the guarded broadcast; imported late)

    world = context.world()
    message, error, seen_at = [0, 0], "", 0.0
    if world.Get_rank() == 0:
        discovery.start()            # a new rank 0 (after a failure) starts polling
        kind, value, error, seen_at = discovery.verdict(world.Get_size(), first)
        message = [kind, value]
    word = np.array(message, dtype=np.int64)
    collectives.broadcast(word, root=0)
    kind, value = int(word[0]), int(word[1])
    if kind == _ASK:             # grow if no rank refuses any more
        still = np.array([grow.refusal() is not None], dtype=np.int64)
        collectives.allreduce(still, still, op="max")
        if not still[0]:
            discovery.forget_failure()
            kind = _GROW
    if kind == _GROW:
        raise HostsAddedInterrupt(world.Get_size(), value, seen_at)
    if not first and grow.last_growth is not None:
        grow.last_growth.settled = True
    if kind == _ERROR:
        text = world.bcast(error, root=0)
        raise DiscoveryError(f"{text} (rank {world.Get_rank()} of {world.Get_size()})")
