"""The elastic loop: run a training function, and after a process failure reset the
world, restore the last commit and run it again (Horovod's ``run_fn``).

``run_fn(func, reset)`` returns ``wrapper(state, *args, **kwargs)``, which

1. under the relaunching supervisor, loads the commit on disk into rank 0's state;
2. :meth:`~mpicoll.elastic.State.sync` (every rank takes rank 0's state), then calls
   ``func(state, *args, **kwargs)`` and returns what it returns;
3. on :class:`~mpicoll.ProcessFailedError` (Horovod's ``HorovodInternalError`` in
   :mod:`mpicoll.torch`): :meth:`~mpicoll.elastic.State.restore` (the last commit), then
   ``reset()`` (shrink the world; again if another rank fails meanwhile), then
   :meth:`~mpicoll.elastic.State.on_reset` (the reset callbacks), and back to 2; a
   callback that raises ends ``run`` with its exception on that rank, as in Horovod
   (under ULFM the others, if they wait for it, see it fail when its program ends:
   :mod:`mpicoll.runtime.exit`);
4. on :class:`~mpicoll.HostsUpdatedInterrupt` (raised by a commit: the state is the
   commit, nothing is restored): when discovery found room for more ranks
   (:class:`~mpicoll.elastic.discovery.HostsAddedInterrupt`), ``grow(new_size)`` starts
   them and merges them into the world (:mod:`mpicoll.elastic.grow`); after a host update
   message (:meth:`~mpicoll.elastic.State.on_hosts_updated`) the world stays as it is;
   then the reset callbacks, and back to 2 (synchronising unless the interrupt says it may
   be skipped: new ranks need the state).

With a discovery (``run(discovery=...)``), the wrapper first has rank 0 poll it once (a
failure raises :class:`~mpicoll.elastic.DiscoveryError` on every rank), and stops polling
when it returns. A process started by a growth enters the wrapper straight at the sync of
step 2, where the running ranks are after their reset.

A process failure that the function's own mpi4py calls on the world raise
(an ``MPI.Exception`` of a failed process) counts as one too. An exception raised
while the world has failed (:mod:`mpicoll.runtime.world`) counts as the process failure
itself, whatever its type: DDP's backward, say, reports a failed
all-reduce as its own ``RuntimeError``.

*A rank that raises is a lost rank* (Horovod's elastic driver drops such a worker): under
ULFM, a rank whose function raises any other exception than mpicoll's own errors that
every rank raises together (:data:`ENDS_THE_JOB`: the :class:`~mpicoll.CollectiveError`
family, mismatches, too few ranks, the reset limit, timeouts; a discovery or growth
failure: those end the job) prints its traceback and leaves the job (it
kills itself: no exit handler runs, so it tells no other rank to stop; see
:func:`_leave`); the others see a process failure and go on without it. An error raised
on every rank so ends every rank, and the job's status is non-zero. ``reset_limit`` bounds how many resets (shrinks and
growths) a job goes through: the next one raises :class:`~mpicoll.ResetLimitError` on
every rank (Horovod's ``--reset-limit``).

*A rank that ends early is a lost rank too*: under ULFM a rank whose function returns (or
calls ``sys.exit(0)``) waits for every other rank's to end (:mod:`mpicoll.elastic.ending`);
when a peer is stuck in a collective it never completed, it leaves as a lost rank and the
others go on without it.

Without ULFM (``mpirun --with-ft ulfm`` with Open MPI) a process failure ends the job as it
would without this module, and exceptions propagate.
"""
from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import time
import traceback
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from .. import config
from ..runtime import exit as runtime_exit
from ..runtime import failures
from ..runtime import world as runtime_world
from ..errors import (CollectiveError, HostsUpdatedInterrupt, ProcessFailedError,
                      ResetLimitError, TooFewRanksError)
from . import discovery as discovery_module
from . import ending
from . import grow as grow_module
from . import shrink as world_module
from .discovery import HostsAddedInterrupt
from .grow import GrowthError
from .launch_hosts import DiscoveryError
from .state import State, load_from_disk

__all__ = ["run_fn", "run", "limits", "MAX_RESETS_PER_FAILURE", "LEFT_STATUS"]

log = logging.getLogger("mpicoll.elastic")

#: Longest chain of resets for one failure (each further one means another rank failed
#: while the survivors were resetting).
MAX_RESETS_PER_FAILURE = 16


#: The exit status of the last rank of a job whose every rank raised in elastic mode.
LEFT_STATUS = 1
#: How long (seconds, per rank in rank order) a rank that raised waits to see whether it
#: is the last one standing before it leaves (:func:`_leave`).
LEAVE_WAIT_S = 0.15


def _failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a process failure: a :class:`~mpicoll.ProcessFailedError`, an
    MPI error that is one (the function's own mpi4py calls on the world), or any exception
    raised while the current world has failed (under ULFM)."""
    if not failures.ENABLED:
        return False
    if isinstance(exc, MPI.Exception):
        exc = failures.translate(exc, None, "an MPI call of the elastic function")
    return isinstance(exc, ProcessFailedError) or (
        isinstance(exc, Exception) and runtime_world.failed(runtime_world.generation()))


#: mpicoll's own errors that every rank raises together: they end the job, no rank leaves.
ENDS_THE_JOB = (CollectiveError, DiscoveryError, GrowthError)


def _leaves(exc: BaseException) -> bool:
    """Whether a rank that raised ``exc`` leaves the job as a lost rank (under ULFM: any
    exception but :data:`ENDS_THE_JOB`, and a ``SystemExit`` with a non-zero status)."""
    if not failures.ENABLED:
        return False
    if isinstance(exc, SystemExit):
        return exc.code not in (0, None)
    return isinstance(exc, Exception) and not isinstance(exc, ENDS_THE_JOB)


def _last_standing(wait_s: float) -> bool:
    """Whether every other rank of the world is known to have failed, within ``wait_s``."""
    world = runtime_world.comm()
    deadline = time.monotonic() + wait_s
    while len(failures.failed_ranks(world, 0.0, progress=True)) < world.Get_size() - 1:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def _leave(exc: BaseException) -> None:
    """Print ``exc``'s traceback and end this process at once, as a lost rank.

    Open MPI's launcher under ULFM goes on after a rank that is killed (and reports status
    0 for it) but stops the job, waiting, when a rank exits with an error status while
    others run. So a rank that leaves kills itself (``SIGKILL``: no exit handler runs, no
    other rank is told to stop), unless every other rank of the world has failed by then:
    the last one ends with :data:`LEFT_STATUS`, so that a job whose every rank raised ends
    with a non-zero status. Ranks wait for that in rank order (rank r at most
    ``LEAVE_WAIT_S * (1 + r)`` seconds), so that when every rank raises, the last in that
    order sees the others gone."""
    world = runtime_world.comm()
    rank = world.Get_rank()
    print(f"mpicoll.elastic: rank {rank} of {world.Get_size()} raised "
          f"{type(exc).__name__} in its elastic function; it leaves the job as a lost rank "
          f"and the others go on without it. Its traceback:", file=sys.stderr)
    traceback.print_exception(exc, file=sys.stderr)
    runtime_exit.flush()
    if _last_standing(LEAVE_WAIT_S * (1 + rank)):
        os._exit(LEFT_STATUS)
    _kill_self()


def _kill_self() -> None:
    """End this process at once (``SIGKILL``: no exit handler runs, no other rank is told
    to stop); Open MPI's launcher under ULFM goes on with the others."""
    os.kill(os.getpid(), signal.SIGKILL)


def _leave_ended(message: str) -> None:
    """A rank whose function ended while the others still need it leaves as a lost rank
    (:mod:`mpicoll.elastic.ending`): say why, and end the process."""
    print(f"mpicoll.elastic: {message}: it leaves the job as a lost rank and the others "
          f"go on without it", file=sys.stderr)
    runtime_exit.flush()
    _kill_self()


def limits(min_np: Any, reset_limit: Any) -> tuple[int, int | None]:
    """:func:`run`'s ``min_np`` and ``reset_limit``, each from the environment when
    ``None`` (``MPICOLL_ELASTIC_MIN_NP``, default 1; ``MPICOLL_ELASTIC_RESET_LIMIT``,
    default no limit).

    Raises:
        ValueError: ``min_np`` is not an int of at least 1, or ``reset_limit`` neither
            ``None`` nor an int of at least 0 (also when read from the environment:
            :func:`mpicoll.config.env_int` names the variable).
    """
    if min_np is None:
        min_np = config.env_int("MPICOLL_ELASTIC_MIN_NP", 1, minimum=1)
    if reset_limit is None:
        reset_limit = config.env_int("MPICOLL_ELASTIC_RESET_LIMIT", None, minimum=0)
    if not isinstance(min_np, int) or min_np < 1:
        raise ValueError(f"min_np must be an int of at least 1, not {min_np!r}")
    if reset_limit is not None and (not isinstance(reset_limit, int) or reset_limit < 0):
        raise ValueError(f"reset_limit must be None or an int of at least 0, not "
                         f"{reset_limit!r}")
    return min_np, reset_limit


def _reset_until_stable(reset: Callable[[], Any]) -> None:
    """``reset()``, again while it fails because another rank failed meanwhile."""
    for attempt in range(MAX_RESETS_PER_FAILURE):
        try:
            reset()
            return
        except (ProcessFailedError, MPI.Exception) as exc:
            if not isinstance(failures.translate(exc, None, "a reset"), ProcessFailedError):
                raise
            log.warning("another failure while resetting (%s); shrinking again", exc)
    raise RuntimeError(f"the world kept failing: {MAX_RESETS_PER_FAILURE} resets in a row")


def _grow_or_reset(exc: HostsUpdatedInterrupt | None, reset: Callable[[], Any],
                   grow: Callable[[int], Any] | None) -> Any:
    """The reset after ``exc`` (``None``: a process failure): grow the world when hosts
    were added (shrink instead if a process fails meanwhile; stay at the size when the new
    processes cannot start), else ``reset()``; after a host update message
    (:meth:`~mpicoll.elastic.State.on_hosts_updated`: no process failed, none was added)
    the world stays as it is. Returns the :class:`~mpicoll.elastic.grow.Growth` or
    :class:`~mpicoll.elastic.Recovery` made, if any."""
    if exc is not None and not isinstance(exc, HostsAddedInterrupt):
        return None
    if grow is not None and isinstance(exc, HostsAddedInterrupt):
        try:
            grow(exc.new_size)
        except GrowthError as err:
            log.error("%s; the job goes on at %d ranks", err, exc.old_size)
            source = discovery_module.active()
            if source is not None:
                source.refuse(exc.new_size, err.refused)   # (see Discovery.refuse)
            return None
        except (ProcessFailedError, MPI.Exception) as err:
            if not isinstance(failures.translate(err, None, "a growth"), ProcessFailedError):
                raise
            log.warning("a process failed while the world grew (%s); shrinking", err)
        else:
            growth = grow_module.last_growth
            if growth is not None:
                growth.detected_at = exc.detected_at
            return growth
    _reset_until_stable(reset)
    return world_module.last_recovery


def _refuse_target(growth: grow_module.Growth, exc: BaseException) -> None:
    """Only processes that ``growth`` (the last reset) started failed, with ``exc``, before
    a commit's check passed: most likely they could not run the program (one raised at
    its top, say): the job shrinks, and does not grow to that size again until
    discovery's answer changes (as when the new processes cannot start), rather than
    start them again and again. (Failing later, they are lost like any rank.)"""
    failed = getattr(exc, "failed_ranks", None)
    source = discovery_module.active()
    if source is None or not failed or min(failed) < growth.old_size or growth.settled:
        return
    source.refuse(growth.new_size)
    log.error("the process(es) the growth to %d ranks started failed; the job does not "
              "grow to %d again until discovery's answer changes", growth.new_size,
              growth.new_size)


def run_fn(func: Callable[..., Any], reset: Callable[[], Any],
           grow: Callable[[int], Any] | None = None,
           hosts: discovery_module.Discovery | None = None,
           reset_limit: int | None = None, min_np: int = 1) -> Callable[..., Any]:
    """``func(state, ...)`` made elastic, with ``reset()`` rebuilding the world after a
    failure, ``grow(new_size)`` growing it when ``hosts`` (a
    :class:`~mpicoll.elastic.discovery.Discovery`) reports more slots, at most
    ``reset_limit`` resets (``None``: no limit; see the module's docstring). A job
    launched with fewer than ``min_np`` ranks and no ``hosts`` to grow it raises
    :class:`~mpicoll.TooFewRanksError` on every rank at the first call; with ``hosts`` it
    waits for the slots first (:func:`_wait_for_min_np`)."""
    first_call = [True]
    if hosts is not None and hosts.max_np is not None and min_np > hosts.max_np:
        raise ValueError(f"min_np={min_np} exceeds max_np={hosts.max_np}: the job could "
                         f"never run")

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, State):
            raise TypeError(f"the first argument of an elastic function must be a "
                            f"mpicoll.elastic.State, not {type(state).__name__}")
        # a process that joined a running job starts where the running ranks' reset ends
        joining = first_call[0] and grow_module.joined is not None
        if first_call[0] and hosts is None and \
                (size := runtime_world.comm().Get_size()) < min_np:
            raise TooFewRanksError(
                f"mpicoll.elastic: the job has {size} rank(s), fewer than min_np={min_np}, "
                f"and no discovery to grow it: launch at least {min_np}", size, min_np, [])
        starting = first_call[0] and not joining
        first_call[0] = False
        try:
            discovery_module.activate(hosts, first=not joining)
            if starting and hosts is not None:
                _wait_for_min_np(hosts, min_np, reset, grow)
            return _loop(func, reset, grow, state, args, kwargs, reset_limit,
                         grow_module.joined.get("resets", 0) if joining else 0)
        finally:
            discovery_module.deactivate()

    return wrapper


def _wait_for_min_np(hosts: discovery_module.Discovery, min_np: int,
                     reset: Callable[[], Any], grow: Callable[[int], Any] | None) -> None:
    """A job launched with fewer than ``min_np`` ranks and a discovery waits, as horovodrun
    does, before its function first runs: every ``hosts.interval`` seconds the ranks agree
    on rank 0's latest poll, and once it offers at least ``min_np`` slots the world grows
    to them (``max_np`` at most). Raises :class:`~mpicoll.TooFewRanksError` on every rank
    when ``MPICOLL_ELASTIC_TIMEOUT`` seconds (rank 0's clock) pass first."""
    # the guarded broadcast, imported late (as discovery does)
    from .. import collectives

    timeout = config.env_float("MPICOLL_ELASTIC_TIMEOUT", 600.0, minimum=0.0)
    deadline = time.monotonic() + timeout
    while (size := runtime_world.comm().Get_size()) < min_np:
        try:
            discovery_module.check_host_updates()
        except HostsAddedInterrupt as exc:
            if exc.new_size >= min_np:
                _grow_or_reset(exc, reset, grow)
                continue
        late = np.array([time.monotonic() >= deadline], dtype=np.int64)
        collectives.broadcast(late, root=0)
        if late[0]:
            raise TooFewRanksError(
                f"mpicoll.elastic: the job has {size} rank(s), fewer than min_np={min_np}, "
                f"and the discovery offered no more slots within MPICOLL_ELASTIC_TIMEOUT="
                f"{timeout:g} s", size, min_np, [])
        time.sleep(max(hosts.interval, 0.01))


def _loop(func: Callable[..., Any], reset: Callable[[], Any],
          grow: Callable[[int], Any] | None, state: State, args: tuple,
          kwargs: dict, reset_limit: int | None = None, resets: int = 0) -> Any:
    """The elastic loop (``resets``: the job's resets so far, which a process that joined
    learns from rank 0, so that every rank stops at the same one)."""
    load_from_disk(state)
    skip_sync = False
    event = None
    while True:
        try:
            if not skip_sync:
                began = time.perf_counter()
                grow_module.end_joining()   # (a new process: the sync is collective)
                state.sync()
                if event is not None:
                    event.phases["sync"] = time.perf_counter() - began
            ending.prepare()
            try:
                result = func(state, *args, **kwargs)
            except SystemExit as exc:
                if exc.code in (0, None):
                    ending.finish(_leave_ended, "called sys.exit(0)")
                raise
            ending.finish(_leave_ended)
            return result
        except HostsUpdatedInterrupt as exc:
            # from a commit: the state is the commit, nothing to restore (Horovod)
            skip_sync = exc.skip_sync
            detected_at = time.time()
            failed_at = restored = time.perf_counter()
            interrupt = exc
        except BaseException as exc:
            if not _failure(exc):
                if _leaves(exc):
                    _leave(exc)
                raise
            detected_at = time.time()
            failed_at = time.perf_counter()
            if isinstance(event, grow_module.Growth):
                _refuse_target(event, exc)
            log.warning("process failure (%s: %s): restoring the last commit and "
                        "shrinking (a rank that raised or ended early said why before "
                        "leaving)", type(exc).__name__, exc)
            state.restore()
            restored = time.perf_counter()
            ending.join_reset()   # ranks whose function ended wait there: they reset too
            skip_sync = False
            interrupt = None
        if reset_limit is not None and resets >= reset_limit:
            raise ResetLimitError(
                f"mpicoll.elastic: the job was to be reset again after {resets} reset(s), "
                f"more than its reset_limit={reset_limit}: it stops", resets + 1, reset_limit)
        resets += 1
        grow_module.facts["resets"] = resets  # (for the processes a growth adds)
        event = _grow_or_reset(interrupt, reset, grow)
        reset_done = time.perf_counter()
        state.on_reset()
        if event is not None:
            if interrupt is None:
                event.detected_at = detected_at
            event.phases.update(restore=restored - failed_at, reset=reset_done - restored,
                                callbacks=time.perf_counter() - reset_done)


def run(func: Callable[..., Any] | None = None, *, min_np: int | None = None,
        max_np: int | None = None, discovery: discovery_module.Source | None = None,
        discovery_interval: float = discovery_module.DEFAULT_INTERVAL_S,
        reset_limit: int | None = None) -> Callable[..., Any]:
    """Decorator: ``func(state, ...)`` goes on after a process failure on the survivors
    (numpy programs: the reset shrinks the world that mpicoll's ``comm=None`` means), and
    grows when ``discovery`` reports room for more ranks.

    ``@mpicoll.elastic.run`` or ``@mpicoll.elastic.run(min_np=3)`` or
    ``@mpicoll.elastic.run(discovery="./discover.sh", max_np=8)``.

    Args:
        func: the training function; its first argument is a
            :class:`~mpicoll.elastic.State`.
        min_np: the least number of ranks to go on with (default
            ``MPICOLL_ELASTIC_MIN_NP``, else 1); below it every survivor raises
            :class:`~mpicoll.TooFewRanksError`.
        max_np: the most ranks to grow to (default ``MPICOLL_ELASTIC_MAX_NP``, else the
            size the job was launched with, as horovodrun's ``--max-np``).
        discovery: a host discovery command (horovodrun's ``--host-discovery-script``
            format) or a callable returning the slots (default
            ``MPICOLL_ELASTIC_DISCOVERY``; none: the job never grows). See
            :mod:`mpicoll.elastic.discovery`. The same on every rank.
        discovery_interval: seconds between two polls of ``discovery`` (on rank 0, off
            the training thread).
        reset_limit: the most resets (shrinks and growths) the job goes through
            (horovodrun's ``--reset-limit``; default ``MPICOLL_ELASTIC_RESET_LIMIT``,
            else no limit); the next raises
            :class:`~mpicoll.ResetLimitError` on every rank.
    Raises:
        ValueError: ``min_np`` below 1, a bad ``max_np``, ``discovery_interval`` or
            ``reset_limit``.
    """
    min_np, reset_limit = limits(min_np, reset_limit)
    hosts = discovery_module.configure(discovery, max_np, discovery_interval)

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        return run_fn(fn, lambda: world_module.shrink_world(min_np), grow_module.grow_world,
                      hosts, reset_limit, min_np)

    return decorate if func is None else decorate(func)
