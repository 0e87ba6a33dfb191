"""The stall inspector: a watchdog thread that explains, on every rank, why a collective waits.

A collective waits forever when a rank skipped it, called another one, disagrees on its
arguments, or has ended. Every mpicoll communicator context numbers and describes its
collectives (:mod:`mpicoll.tracking`); one daemon thread per process watches them, talking
to its peers on a private duplicate of each communicator (so it needs
``MPI_THREAD_MULTIPLE``; at a lower thread level it is off and says so once).

- When a call has waited ``MPICOLL_STALL_WARN_SECONDS`` (default 60), the thread asks every
  peer what it is doing and logs (logger ``mpicoll.stall``) which ranks are in the same
  call, which have not entered it, which are inside a different one (its name and sequence
  number), which disagree on its arguments (now, or in an earlier call still remembered),
  and which did not answer. Each asked rank that is not in that call logs its side too.
  It asks again every further ``MPICOLL_STALL_WARN_SECONDS`` of the same wait.
- ``MPICOLL_STALL_ABORT_SECONDS`` (default 0: off): a call that has waited that long
  aborts the job (``MPI_Abort``) after logging the report.
- A process that ends while its peers go on (its script returned, ``sys.exit``, an
  uncaught exception without ``-m mpi4py``, pytest returning after a failed test) tells
  every peer at exit how many collectives it completed on each communicator. A peer that
  is, or later gets, stuck in a call the leaver never completed aborts the job within
  about :data:`LEFT_GRACE_SECONDS`, with a message naming the rank that left. Ranks that
  end together receive each other's notices before they finalize MPI (a notice left
  unreceived at ``MPI_Finalize`` is an error; UCX warns about each one).
- In elastic mode under ULFM a rank whose training function ended sends the same notice
  while its process goes on (:func:`announce_end`: it waits for the others to end too). A
  peer stuck in a call that rank never completed does not abort then: it asks the rank to
  leave (``on_needed``: :mod:`mpicoll.elastic` ends it as a lost rank, so the peers see a
  process failure and go on without it), and aborts only if it is still stuck
  :data:`NEEDED_GRACE_SECONDS` later.

``MPICOLL_STALL_WARN_SECONDS=0`` turns all of it off. The calling thread only pays for the
counting in :mod:`mpicoll.tracking`; everything else happens on the watchdog thread.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import sys
import threading
import time
import warnings
from typing import Any, Callable

from mpi4py import MPI

from . import config, tracking
from .runtime import comms, failures
from .runtime import exit as runtime_exit
from .runtime import world as runtime_world
from .tracking import CallInfo, Tracker

__all__ = ["enabled", "watch", "unwatch", "announce_exit", "announce_end", "ended_peers",
           "ask_ended_to_leave", "end_over", "Watched", "POLL_SECONDS", "LEFT_GRACE_SECONDS",
           "NEEDED_GRACE_SECONDS", "ANSWER_SECONDS", "EXIT_WAIT_SECONDS",
           "EXIT_REPLY_SECONDS"]

log = logging.getLogger("mpicoll.stall")

#: How often the watchdog looks at the calls in progress and at its messages.
POLL_SECONDS = 0.1
#: How long a call may still run after a peer left without completing it.
LEFT_GRACE_SECONDS = 1.0
#: After asking a rank whose elastic function ended to leave, how long a peer stuck on it
#: waits for it to go before aborting the job.
NEEDED_GRACE_SECONDS = 10.0
#: How long a stalled rank waits for its peers' answers before it logs the report.
ANSWER_SECONDS = 2.0
#: At exit, how long a rank waits for the exit notices of peers that have not left yet.
EXIT_WAIT_SECONDS = 2.0
#: A peer whose exit notice came in less than this long ago still waits for this rank's.
EXIT_REPLY_SECONDS = 1.0

_QUERY, _REPLY, _LEFT, _NEEDED = 31001, 31002, 31003, 31004
_lock = threading.Lock()
_watched: list["Watched"] = []
_thread: threading.Thread | None = None
_stop = threading.Event()
_said_off = False
#: While this rank's elastic function has ended and it waits for the others: called (on the
#: watchdog thread) with a description when a peer is stuck on a call it never completed.
_on_needed: Callable[[str], None] | None = None


def warn_seconds() -> float:
    """``MPICOLL_STALL_WARN_SECONDS`` (0 turns the inspector off)."""
    return config.env_float("MPICOLL_STALL_WARN_SECONDS", 60.0, minimum=0.0)


def abort_seconds() -> float:
    """``MPICOLL_STALL_ABORT_SECONDS`` (0: never abort)."""
    return config.env_float("MPICOLL_STALL_ABORT_SECONDS", 0.0, minimum=0.0)


def enabled() -> bool:
    """Whether the inspector runs in this process (on, and MPI at THREAD_MULTIPLE)."""
    global _said_off
    if warn_seconds() <= 0:
        return False
    abort_seconds()       # (a bad value raises here, on the caller's thread of every rank,
    #                       not in the watchdog's, which it would end silently)
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        if not _said_off:
            _said_off = True
            warnings.warn("mpicoll: the stall inspector is off: MPI was initialized below "
                          "MPI_THREAD_MULTIPLE (its watchdog thread calls MPI)", RuntimeWarning,
                          stacklevel=3)
        return False
    return True


class Watched:
    """One communicator as the watchdog sees it."""

    def __init__(self, comm: MPI.Intracomm, tracker: Tracker) -> None:
        self.comm = comms.dup(comm, "watchdog")  # collective: made with the context
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.tracker = tracker
        self.world = _world_ranks(comm)
        self.left: dict[int, int] = {}          # rank -> collectives it completed
        self.left_at: dict[int, float] = {}     # rank -> when its exit notice came in
        self.ended: set[int] = set()            # of those, ranks whose process goes on
        self.asked: dict[int, float] = {}       # rank -> when it was asked to leave
        self.sends: list[MPI.Request] = []
        self.seq = 0                             # the call in progress being timed
        self.since = 0.0
        self.next_query = 0.0
        self.query: dict[str, Any] | None = None
        self.left_stuck_since: float | None = None
        self.answered: tuple[int, int] | None = None  # the wait last logged by _answer
        self.answered_at = 0.0

    def who(self, rank: int) -> str:
        """``rank 2`` (``rank 2 (world rank 5)`` on a communicator other than the world:
        its rank in the current world, the grown or shrunk one in elastic mode)."""
        world = self.world[rank]
        return f"rank {rank}" if world == rank else f"rank {rank} (world rank {world})"

    def send(self, obj: Any, dest: int, tag: int) -> None:
        with contextlib.suppress(MPI.Exception):  # a peer already gone: nothing to tell it
            self.sends.append(self.comm.isend(obj, dest=dest, tag=tag))


def _world_ranks(comm: MPI.Intracomm) -> list[int]:
    """``comm``'s ranks in the current world (:func:`mpicoll.runtime.world.world_ranks`);
    a rank outside it, or a communicator that cannot be queried, is named by its own."""
    try:
        world = runtime_world.world_ranks(comm)
    except MPI.Exception:
        return list(range(comm.Get_size()))
    return [r if w == MPI.UNDEFINED else w for r, w in enumerate(world)]


def watch(comm: MPI.Intracomm, tracker: Tracker) -> Watched | None:
    """Start watching ``comm`` (collective over it; ``None`` when the inspector is off or
    ``comm`` has one rank)."""
    global _thread
    if comm.Get_size() < 2 or not enabled():
        return None
    watched = Watched(comm, tracker)
    tracking.INSPECTED = True
    with _lock:
        _watched.append(watched)
        if _thread is None:
            _stop.clear()
            _thread = threading.Thread(target=_loop, name="mpicoll-watchdog", daemon=True)
            _thread.start()
    return watched


def unwatch(watched: Watched | None) -> None:
    """Stop watching (the communicator is being freed) and free the duplicate
    (only forgotten, for a communicator with a dead peer: :func:`mpicoll.runtime.comms.free`)."""
    if watched is None:
        return
    with _lock:
        if watched in _watched:
            _watched.remove(watched)
    comms.free(watched.comm)


def _drop_failed(w: Watched, exc: MPI.Exception) -> bool:
    """After an MPI error on ``w``'s communicator: stop watching it, without freeing it,
    if the error reports a process failure or a revocation (ULFM); nothing more can be
    said or asked there, and its pending sends must never be freed (Open MPI ends the job
    when a freed send to a dead process fails). Returns whether it was dropped (the error
    is logged, at debug level, if not)."""
    if failures.failed_by(exc, w.comm) is None:
        log.debug("watchdog: %s", exc)
        return False
    failures.keep_requests(w.sends)
    w.sends = []
    if w in _watched:
        _watched.remove(w)
    log.debug("watchdog: %s; no longer watched", exc)
    return True


def announce_exit() -> None:
    """At interpreter exit: stop the thread; tell every peer how far this rank got.

    The notice goes to every peer not known to have left, and to those whose own notice
    came in less than :data:`EXIT_REPLY_SECONDS` ago (they are still waiting here, below).
    Then this rank receives notices until every peer's has come in, or for at most
    :data:`EXIT_WAIT_SECONDS`: ranks that end together (the usual case) thus receive every
    notice sent to them before they finalize MPI, and one that ends much later gets the
    early ranks' notices (and sends them none) when it ends.
    """
    global _thread
    _stop.set()
    if _thread is not None:
        _thread.join(timeout=2.0)
        _thread = None
    if MPI.Is_finalized():
        return
    with _lock:
        for w in list(_watched):
            if failures.peer_failed(w.comm):   # ULFM knows a peer to have failed
                _drop_failed(w, MPI.Exception(failures.PROC_FAILED))
                continue
            _collect_left(w)
            now = time.monotonic()
            for peer in range(w.size):
                if peer != w.rank and (peer not in w.left
                                       or now - w.left_at[peer] < EXIT_REPLY_SECONDS):
                    w.send((w.tracker.completed(),), peer, _LEFT)
        deadline = time.monotonic() + EXIT_WAIT_SECONDS
        while True:
            waiting = False
            for w in list(_watched):
                try:
                    _reap(w)
                except MPI.Exception as exc:  # a dead peer (ULFM): stop waiting for it
                    if _drop_failed(w, exc):
                        continue
                _collect_left(w)
                waiting = waiting or bool(w.sends) or len(w.left) < w.size - 1
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(0.001)


def _collect_left(w: Watched) -> None:
    """Receive the exit notices peers have already sent (into ``w.left``).

    A peer that has left may have finalized MPI: a message sent to it can wait forever
    (over MPICH's ofi/tcp an ``isend`` to a finalized process spins in the progress
    engine), and this rank would then never reach ``MPI_Finalize`` or free a shared
    window its node peers wait on. So the exit notice goes only to peers not known gone,
    or known to have left so lately that they still wait for it (:func:`announce_exit`).
    """
    status = MPI.Status()
    try:
        while w.comm.iprobe(MPI.ANY_SOURCE, _LEFT, status):
            source = status.Get_source()
            _note_left(w, source, w.comm.recv(source=source, tag=_LEFT))
    except MPI.Exception as exc:  # never fail an exit over a notice
        log.debug("watchdog: %s", exc)


def _note_left(w: Watched, source: int, notice: tuple) -> None:
    """Record a peer's notice: ``(collectives completed,)``, or ``(completed, True)`` from
    :func:`announce_end` (its process goes on)."""
    w.left[source] = notice[0]
    w.left_at[source] = time.monotonic()
    if len(notice) > 1 and notice[1]:
        w.ended.add(source)
    else:
        w.ended.discard(source)


def _loop() -> None:
    while not _stop.wait(POLL_SECONDS):
        with _lock:
            for w in list(_watched):
                try:
                    _poll(w, time.monotonic())
                except MPI.Exception as exc:  # never let the watchdog kill the process
                    _drop_failed(w, exc)


def _reap(w: Watched) -> None:
    w.sends = [req for req in w.sends if not req.Test()]


def _poll(w: Watched, now: float) -> None:
    _reap(w)
    status = MPI.Status()
    while w.comm.iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
        source, tag = status.Get_source(), status.Get_tag()
        message = w.comm.recv(source=source, tag=tag)
        if tag == _QUERY:
            _answer(w, source, *message)
        elif tag == _REPLY and w.query is not None and message[0] == w.query["seq"]:
            w.query["replies"][source] = message
        elif tag == _LEFT:
            _note_left(w, source, message)
        elif tag == _NEEDED and _on_needed is not None and \
                (message[0] is None or w.tracker.entered < message[0]):
            # (a call this rank has entered since its notice will complete: not needed)
            _on_needed(f"{w.who(source)} waits for it in {message[1]} on {w.tracker.name}")
    _check(w, now)


def _check(w: Watched, now: float) -> None:
    t = w.tracker
    seq = t.entered
    if t.done >= seq:  # nothing in progress
        w.seq, w.query, w.left_stuck_since = 0, None, None
        return
    if seq != w.seq:
        w.seq, w.since, w.next_query = seq, now, now + warn_seconds()
        w.query, w.left_stuck_since = None, None
    waited = now - w.since
    _check_left(w, seq, now, waited)
    if now >= w.next_query:
        _ask(w, seq, waited)
        w.next_query = now + warn_seconds()
    if w.query is not None and not w.query.get("logged") and (
            len(w.query["replies"]) == w.size - 1 or now >= w.query["deadline"]):
        w.query["logged"] = True
        log.warning(_report(w, w.query))
    limit = abort_seconds()
    if limit > 0 and waited >= limit:
        if w.query is None:          # the report first: its answers come by later polls
            _ask(w, seq, waited)
        if not w.query.get("logged"):    # (answered by every peer, or its deadline past)
            return
        _abort(f"{_report(w, w.query)}\n  aborting: waited longer than "
               f"MPICOLL_STALL_ABORT_SECONDS={limit:g}")


def _check_left(w: Watched, seq: int, now: float, waited: float) -> None:
    gone = sorted(r for r, done in w.left.items() if done < seq)
    if not gone:
        return
    if w.left_stuck_since is None:
        w.left_stuck_since = now
    elif now - w.left_stuck_since >= LEFT_GRACE_SECONDS:
        if _ask_to_leave(w, seq, gone, now):
            return
        names = ", ".join(f"{w.who(r)} (after completing {w.left[r]} collectives on it)"
                          for r in gone)
        how = ("ended its elastic function and did not leave when asked"
               if all(r in w.asked for r in gone) else "ended its process")
        _abort(f"{_headline(w, seq, waited)}\n  {names} {how} and will never take part in "
               f"it: aborting the job")


def _ask_to_leave(w: Watched, seq: int, gone: list[int], now: float) -> bool:
    """Ranks of ``gone`` whose elastic function ended (their process goes on): ask each once
    to leave the job as a lost rank. Returns whether to wait for them (every rank of
    ``gone`` is such a rank, asked less than :data:`NEEDED_GRACE_SECONDS` ago)."""
    if not all(r in w.ended for r in gone):
        return False
    info = w.tracker.info(seq)
    what = f"{info.describe() if info else 'a collective'} #{seq}"
    for r in gone:
        _ask_once(w, r, seq, what, now)
    return all(now - w.asked[r] < NEEDED_GRACE_SECONDS for r in gone)


def _ask_once(w: Watched, r: int, seq: int | None, what: str, now: float) -> None:
    """Ask rank ``r`` of ``w``, whose elastic function ended, to leave (once): this rank
    waits for it in ``what`` (call ``seq`` of ``w``; ``None``: a wait the tracker does not
    number)."""
    if r in w.asked:
        return
    w.asked[r] = now
    log.warning("mpicoll stall inspector: %s ended its elastic function while %s waits for "
                "it in %s: asking it to leave the job as a lost rank", w.who(r),
                w.who(w.rank), what)
    w.send((seq, what), r, _NEEDED)


def announce_end(on_needed: Callable[[str], None]) -> bool:
    """Elastic mode: this rank's training function has ended and its process waits for the
    others' to end. Tell every peer how far this rank got (as at exit); until
    :func:`end_over`, a peer stuck on a call this rank never completed makes the watchdog
    call ``on_needed(description)``. Returns whether the peers were told (``False``: the
    inspector is off or watches nothing)."""
    global _on_needed
    with _lock:
        _on_needed = on_needed
        if _thread is None or not _watched:
            return False
        for w in list(_watched):
            for peer in range(w.size):
                if peer != w.rank:
                    w.send((w.tracker.completed(), True), peer, _LEFT)
    return True


def _into(comm: MPI.Intracomm) -> list[tuple[Watched, list[int]]]:
    """Every watched communicator with its ranks' ranks in ``comm`` (-1: not in it)."""
    out = []
    group = comm.Get_group()
    try:
        for w in _watched:
            try:
                mine = w.comm.Get_group()
                try:
                    ranks = MPI.Group.Translate_ranks(mine, list(range(w.size)), group)
                finally:
                    mine.Free()
            except MPI.Exception:
                continue
            out.append((w, [r if r is not None and r >= 0 else -1 for r in ranks]))
    finally:
        group.Free()
    return out


def ended_peers(comm: MPI.Intracomm) -> tuple[set[int], set[int]]:
    """Ranks of ``comm`` (other than this one) this rank watches a communicator with, and
    those of them whose elastic function ended (their :func:`announce_end` notice came)."""
    covered: set[int] = set()
    ended: set[int] = set()
    with _lock:
        for w, ranks in _into(comm):
            for r, theirs in enumerate(ranks):
                if r != w.rank and theirs >= 0:
                    covered.add(theirs)
                    if r in w.ended:
                        ended.add(theirs)
    return covered, ended


def ask_ended_to_leave(comm: MPI.Intracomm, what: str) -> None:
    """For a client stuck in an operation on ``comm`` that the inspector does not see (the
    Horovod engine's negotiation): ask every rank of ``comm`` whose elastic function ended
    to leave as a lost rank (once each)."""
    now = time.monotonic()
    with _lock:
        for w, ranks in _into(comm):
            for r in sorted(w.ended):
                if ranks[r] >= 0:
                    _ask_once(w, r, None, what, now)


def end_over() -> None:
    """The wait that :func:`announce_end` began is over: peers' requests are ignored."""
    global _on_needed
    _on_needed = None


def _headline(w: Watched, seq: int, waited: float) -> str:
    info = w.tracker.info(seq)
    what = info.describe() if info else "a collective"
    return (f"mpicoll stall inspector: {w.who(w.rank)} has waited {waited:.1f} s in {what} "
            f"#{seq} on {w.tracker.name} ({w.size} ranks)")


def _ask(w: Watched, seq: int, waited: float) -> None:
    w.query = {"seq": seq, "waited": waited, "replies": {},
               "deadline": time.monotonic() + ANSWER_SECONDS}
    for peer in range(w.size):
        if peer != w.rank:
            w.send((seq, w.tracker.info(seq), waited), peer, _QUERY)


def _answer(w: Watched, source: int, seq: int, info: CallInfo | None, waited: float) -> None:
    """Tell a stalled peer what this rank is doing; log it here if it is not that call."""
    t = w.tracker
    current = t.info(t.entered) if t.entered > t.done else None
    w.send((seq, t.entered, t.done, current, t.recent(seq)), source, _REPLY)
    now = time.monotonic()
    if (t.entered == seq and current == info) or (
            w.answered == (seq, t.entered) and now - w.answered_at < warn_seconds() * 0.9):
        return  # in that call too, or this wait was told here lately (by another asker)
    w.answered, w.answered_at = (seq, t.entered), now
    what = info.describe() if info else "a collective"
    here = (f"is in {current.describe()} #{t.entered}" if current is not None
            else f"is not in an mpicoll collective on it (completed {t.done})")
    made = t.info(seq) if seq <= t.entered else None
    diff = made.differences(info) if made is not None and info is not None else []
    if diff and (made is not current or t.entered != seq):
        here += f"; its own call #{seq} differed: {', '.join(diff)}"
    elif diff:
        here = f"is in that call with other arguments: {', '.join(diff)}"
    log.warning(f"mpicoll stall inspector: {w.who(source)} has waited {waited:.1f} s in "
                f"{what} #{seq} on {t.name}; this rank ({w.who(w.rank)}) {here}")


def _report(w: Watched, query: dict) -> str:
    """The report of a stalled call from every answer received."""
    seq, replies, t = query["seq"], query["replies"], w.tracker
    mine = t.info(seq)
    groups: dict[str, list[str]] = {"in the same call": [],
                                    "have not entered it": [], "inside a different one": [],
                                    "disagree on its arguments": [], "past it": [],
                                    "did not answer": []}
    earlier: list[str] = []
    for peer in range(w.size):
        if peer == w.rank:
            groups["in the same call"].append(w.who(peer))
            continue
        if peer not in replies:
            groups["did not answer"].append(w.who(peer))
            continue
        _classify(w, peer, seq, mine, replies[peer], groups)
        earlier += _earlier_disagreement(w, peer, seq, replies[peer][4])
    lines = [_headline(w, seq, query["waited"])]
    lines += [f"  {label}: {', '.join(names)}" for label, names in groups.items() if names]
    lines += [f"  earlier disagreement: {line}" for line in earlier]
    return "\n".join(lines)


def _classify(w: Watched, peer: int, seq: int, mine: CallInfo | None, reply: tuple,
              groups: dict[str, list[str]]) -> None:
    """File ``peer`` under one heading of the report, from its answer."""
    _, entered, done, current, recent = reply
    name = w.who(peer)
    inside = current is not None and entered == seq
    theirs = current if inside else recent.get(seq)  # its call #seq, if it made one
    diff = mine.differences(theirs) if mine is not None and theirs is not None else []
    now = ("" if inside else f"; now in {current.describe()} #{entered}" if current
           else f"; completed {done}")
    if inside and not diff:
        groups["in the same call"].append(name)
    elif diff and theirs.collective != mine.collective:
        groups["inside a different one"].append(f"{name} in {theirs.describe()} #{seq}{now}")
    elif diff:
        groups["disagree on its arguments"].append(f"{name}: {', '.join(diff)}{now}")
    elif current is not None:
        groups["inside a different one"].append(f"{name} in {current.describe()} #{entered}")
    elif done < seq:
        groups["have not entered it"].append(f"{name} (completed {done}, not in an mpicoll "
                                             f"collective on this communicator)")
    else:
        groups["past it"].append(f"{name} (completed {done})")


def _earlier_disagreement(w: Watched, peer: int, seq: int, recent: dict) -> list[str]:
    """The first earlier call, still remembered by both, where ``peer`` differed."""
    for s in sorted(recent):
        if s >= seq:
            break
        mine, theirs = w.tracker.info(s), recent[s]
        diff = mine.differences(theirs) if mine is not None else []
        if diff:
            return [f"#{s}: {w.who(peer)} differed: {', '.join(diff)} (it called "
                    f"{theirs.describe()}, this rank {mine.describe()})"]
    return []


def _abort(message: str) -> None:
    if log.hasHandlers():
        log.error(message)
    _print_uncaptured(message)
    runtime_exit.abort(1)


def _print_uncaptured(message: str) -> None:
    """Print to the process's real stderr, even inside a pytest test.

    pytest captures file descriptors 1 and 2 during a test and shows the capture only when
    the test ends, which an aborted process never reaches: the message would be lost. Its
    capture manager is found among live objects (only when aborting) and suspended while
    the message is written.
    """
    capture = sys.modules.get("_pytest.capture")
    if capture is not None:
        for obj in gc.get_objects():
            if isinstance(obj, capture.CaptureManager):
                with obj.global_and_fixture_disabled():
                    print(message, file=sys.stderr, flush=True)
                return
    print(message, file=sys.stderr, flush=True)
