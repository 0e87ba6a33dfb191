"""The end of an elastic function: ranks end together, or one that ended early is lost.

Under ULFM a rank whose elastic function returns (or raises ``SystemExit`` with status 0)
while the others train on would leave them waiting at their next collective: it is alive
(no process failure to recover from) and will never join. So a rank whose function ended
does not return from :func:`mpicoll.elastic.run` at once: :func:`finish`

1. tells its peers how far it got (the stall inspector's exit notice,
   :func:`mpicoll.watchdog.announce_end`), and
2. once every peer it shares a watched communicator with has sent the same notice (at
   once, with the inspector off), joins an agreement over the world's *end communicator*
   (ULFM's fault-tolerant ``MPIX_Comm_iagree`` on a duplicate of the world made by
   :func:`prepare` when the function starts), which completes once every live rank has
   ended.

Three ways out:

- every rank ended (or the others failed): :func:`finish` returns, and so does ``run``;
- a peer is stuck in a collective this rank never completed: its stall inspector asks this
  rank to leave, and it does, as a lost rank (``leave``: the runner prints why and ends
  the process; the peers see a process failure and go on from their last commit without
  it), within about a second of its end (:data:`mpicoll.watchdog.LEFT_GRACE_SECONDS`);
- no peer asked (the inspector is off, or they wait in a call it does not see) and the
  others have not ended within ``MPICOLL_ELASTIC_END_WAIT_S`` seconds (default
  :data:`END_WAIT_S`; 0: no bound): this rank leaves the same way.

A rank whose peers only work longer (rank 0 evaluating alone after the last collective)
is never asked, and waits for them up to that bound.

A failure while some ranks wait: every survivor still in the function sees it and, before
the shrink, joins the same agreement saying "not ended" (:func:`join_reset`); the agreement
(whose value and error are the same on every live rank) then tells the waiting ranks to
reset too (:func:`finish` raises :class:`~mpicoll.ProcessFailedError`), and every survivor
runs the function again from the last commit. When every live rank had ended, the
agreement completes without the dead one and the job ends.

Without ULFM nothing of this happens (a failure ends the job anyway).
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable

from .. import config, watchdog
from ..errors import ProcessFailedError
from ..runtime import comms, failures
from ..runtime import world as runtime_world

__all__ = ["prepare", "finish", "join_reset", "END_WAIT_S", "end_wait_s"]

#: Default of ``MPICOLL_ELASTIC_END_WAIT_S``: how long a rank whose function ended waits
#: for the others' before it leaves as a lost rank, when no peer asked it to.
END_WAIT_S = 300.0
#: How often the wait looks at the agreement and for failures.
POLL_S = 0.005

#: [generation, the end communicator of that world]: only the current world's is kept.
_end: list[Any] = [None, None]
#: Generations whose end agreement this rank has begun (it runs once per world).
_agreed: set[int] = set()
#: (request, buffer) of the end agreements :func:`join_reset` began, until completed.
_resetting: list[tuple[Any, Any]] = []


def end_wait_s() -> float:
    """``MPICOLL_ELASTIC_END_WAIT_S`` (seconds; 0: no bound)."""
    return config.env_float("MPICOLL_ELASTIC_END_WAIT_S", END_WAIT_S, minimum=0.0)


def prepare() -> None:
    """Before the function runs (every rank of the world calls it there): complete the
    agreements :func:`join_reset` began, and make the current world's end communicator,
    once per world (a duplicate that lives as long as the world:
    :func:`mpicoll.runtime.comms.release_world` frees it)."""
    if not failures.ENABLED:
        return
    while _resetting:
        request, _ = _resetting[0]
        while not failures.agreement_over(request):
            time.sleep(POLL_S)
        _resetting.pop(0)
    gen = runtime_world.generation()
    _agreed.discard(gen)      # a function run again on the same world ends again
    if _end[0] != gen:
        _end[:] = [gen, comms.dup(runtime_world.comm(), "elastic.end", lifetime="world")]


def finish(leave: Callable[[str], None], how: str = "returned") -> None:
    """This rank's function ended (``how``: "returned", "called sys.exit(0)"): wait until
    every live rank's has (see the module's docstring). ``leave(message)`` ends this
    process as a lost rank; it may be called on the stall inspector's thread.

    Raises:
        ProcessFailedError: a rank failed before every rank's function ended (the others
            reset: so does this one, and runs the function again from the last commit).
    """
    gen = runtime_world.generation()
    if _end[0] != gen or gen in _agreed:
        return
    world = runtime_world.comm()
    rank = world.Get_rank()

    def asked(why: str) -> None:
        leave(f"rank {rank}'s elastic function {how} while {why}")

    limit = end_wait_s()
    deadline = time.monotonic() + limit if limit > 0 else math.inf

    def wait() -> None:
        if time.monotonic() >= deadline:
            leave(f"rank {rank}'s elastic function {how} {limit:g} s ago and the others' "
                  f"have not ended (MPICOLL_ELASTIC_END_WAIT_S)")
        time.sleep(POLL_S)

    try:
        if watchdog.announce_end(asked):
            # the agreement starts once every peer seen through the inspector has ended
            # too (or one failed: the others reset and join it), so that a rank asked to
            # leave leaves no agreement behind (Open MPI reports one the others never
            # joined as erroneous at their exit)
            while True:
                covered, ended = watchdog.ended_peers(world)
                if covered <= ended or failures.failed_ranks(world, 0.0, progress=True):
                    break
                wait()
        everyone_ended = _agree(gen, 1, wait)
    finally:
        watchdog.end_over()
    if not everyone_ended:
        ranks = failures.failed_ranks(world)
        failures.fail_world(world, ranks)
        raise ProcessFailedError(
            f"rank(s) {ranks} failed before every rank's elastic function had ended (rank "
            f"{rank} had ended); it resets with the others", ranks)


def join_reset() -> None:
    """After a process failure, before the shrink (every survivor calls it once): join the
    failed world's end agreement saying "not ended", so that ranks whose function ended
    and wait in it learn that the others reset, and reset too. Non-blocking: the agreement
    runs while the survivors shrink (the waiting ranks join the shrink once it completes);
    :func:`prepare` completes it."""
    gen = runtime_world.generation()
    if _end[0] == gen and gen not in _agreed:
        _agreed.add(gen)
        _resetting.append(failures.start_agreement(_end[1], 0))


def _agree(gen: int, flag: int, wait: Callable[[], None]) -> bool:
    """Run world ``gen``'s end agreement with ``flag`` (1: ended, 0: resetting), calling
    ``wait()`` between tests; returns the agreed value (whether every live rank ended). A
    rank that failed before joining does not count (ULFM's agreement completes without
    it, with the same value and error on every live rank)."""
    _agreed.add(gen)
    request, buf = failures.start_agreement(_end[1], flag)
    while not failures.agreement_over(request):
        wait()
    return bool(buf[0])
