"""The elastic loop: run a training function, and after a process failure reset the
world, restore the last commit and run it again (Horovod's ``run_fn``).

``run_fn(func, reset)`` returns ``wrapper(state, *args, **kwargs)``, which

1. under the relaunching supervisor, loads the commit on disk into rank 0's state;
2. :meth:`~mpicoll.elastic.State.sync` (every rank takes rank 0's state), then calls
   ``func(state, *args, **kwargs)`` and returns what it returns;
3. on :class:`~mpicoll.ProcessFailedError` (Horovod's ``HorovodInternalError`` in
   :mod:`mpicoll.torch`): :meth:`~mpicoll.elastic.State.restore` (the last commit), then
   ``reset()`` (shrink the world; again if another rank fails meanwhile), then
   :meth:`~mpicoll.elastic.State.on_reset` (the reset callbacks), and back to 2;
4. on :class:`~mpicoll.HostsUpdatedInterrupt` (raised by a commit: the state is the
   commit, nothing is restored): when discovery found room for more ranks
   (:class:`~mpicoll.elastic.discovery.HostsAddedInterrupt`), ``grow(new_size)`` starts
   them and merges them into the world (:mod:`mpicoll.elastic.grow`), else ``reset()``;
   then the reset callbacks, and back to 2 (synchronising unless the interrupt says it may
   be skipped: new ranks need the state).

With a discovery (``run(discovery=...)``), the wrapper first has rank 0 poll it once (a
failure raises :class:`~mpicoll.elastic.DiscoveryError` on every rank), and stops polling
when it returns. A process started by a growth enters the wrapper straight at the sync of
step 2, where the running ranks are after their reset.

Other exceptions propagate. Without ULFM (``mpirun --with-ft ulfm`` with Open MPI) a
process failure ends the job as it would without this module.
"""
from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable

from mpi4py import MPI

from ..runtime import failures
from ..errors import HostsUpdatedInterrupt, ProcessFailedError
from . import discovery as discovery_module
from . import grow as grow_module
from . import shrink as world_module
from .discovery import HostsAddedInterrupt
from .grow import GrowthError
from .state import State, load_from_disk

__all__ = ["run_fn", "run", "MAX_RESETS_PER_FAILURE"]

log = logging.getLogger("mpicoll.elastic")

#: Longest chain of resets for one failure (each further one means another rank failed
#: while the survivors were resetting).
MAX_RESETS_PER_FAILURE = 16


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
    processes cannot start), else ``reset()``. Returns the :class:`~mpicoll.elastic.grow.Growth` or
    :class:`~mpicoll.elastic.Recovery` made, if any."""
    if grow is None or not isinstance(exc, HostsAddedInterrupt):
        _reset_until_stable(reset)
        return world_module.last_recovery
    try:
        grow(exc.new_size)
    except GrowthError as err:
        log.error("%s; the job goes on at %d ranks", err, exc.old_size)
        source = discovery_module.active()
        if source is not None:
            source.failed_target = exc.new_size      # not again until discovery changes
        return None
    except (ProcessFailedError, MPI.Exception) as err:
        if not isinstance(failures.translate(err, None, "a growth"), ProcessFailedError):
            raise
        log.warning("a process failed while the world grew (%s); shrinking", err)
        _reset_until_stable(reset)
        return world_module.last_recovery
    growth = grow_module.last_growth
    if growth is not None:
        growth.detected_at = exc.detected_at
    return growth


def run_fn(func: Callable[..., Any], reset: Callable[[], Any],
           grow: Callable[[int], Any] | None = None,
           hosts: discovery_module.Discovery | None = None) -> Callable[..., Any]:
    """``func(state, ...)`` made elastic, with ``reset()`` rebuilding the world after a
    failure, ``grow(new_size)`` growing it when ``hosts`` (a
    :class:`~mpicoll.elastic.discovery.Discovery`) reports more slots (see the module's
    docstring)."""
    first_call = [True]

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, State):
            raise TypeError(f"the first argument of an elastic function must be a "
                            f"mpicoll.elastic.State, not {type(state).__name__}")
        # a process that joined a running job starts where the running ranks' reset ends
        joining = first_call[0] and grow_module.joined is not None
        first_call[0] = False
        try:
            discovery_module.activate(hosts, first=not joining)
            return _loop(func, reset, grow, state, args, kwargs)
        finally:
            discovery_module.deactivate()

    return wrapper


def _loop(func: Callable[..., Any], reset: Callable[[], Any],
          grow: Callable[[int], Any] | None, state: State, args: tuple,
          kwargs: dict) -> Any:
    load_from_disk(state)
    skip_sync = False
    event = None
    while True:
        try:
            if not skip_sync:
                began = time.perf_counter()
                state.sync()
                if event is not None:
                    event.phases["sync"] = time.perf_counter() - began
            return func(state, *args, **kwargs)
        except ProcessFailedError as exc:
            if not failures.ENABLED:
                raise
            detected_at = time.time()
            failed_at = time.perf_counter()
            log.warning("process failure (%s): restoring the last commit and "
                        "shrinking", exc)
            state.restore()
            restored = time.perf_counter()
            skip_sync = False
            interrupt = None
        except HostsUpdatedInterrupt as exc:
            # from a commit: the state is the commit, nothing to restore (Horovod)
            skip_sync = exc.skip_sync
            detected_at = time.time()
            failed_at = restored = time.perf_counter()
            interrupt = exc
        event = _grow_or_reset(interrupt, reset, grow)
        reset_done = time.perf_counter()
        state.on_reset()
        if event is not None:
            if interrupt is None:
                event.detected_at = detected_at
            event.phases.update(restore=restored - failed_at, reset=reset_done - restored,
                                callbacks=time.perf_counter() - reset_done)


def run(func: Callable[..., Any] | None = None, *, min_np: int = 1,
        max_np: int | None = None, discovery: discovery_module.Source | None = None,
        discovery_interval: float = discovery_module.DEFAULT_INTERVAL_S) -> Callable[..., Any]:
    """Decorator: ``func(state, ...)`` goes on after a process failure on the survivors
    (numpy programs: the reset shrinks the world that mpicoll's ``comm=None`` means), and
    grows when ``discovery`` reports room for more ranks.

    ``@mpicoll.elastic.run`` or ``@mpicoll.elastic.run(min_np=3)`` or
    ``@mpicoll.elastic.run(discovery="./discover.sh", max_np=8)``.

    Args:
        func: the training function; its first argument is a
            :class:`~mpicoll.elastic.State`.
        min_np: the least number of ranks to go on with (default 1); below it every
            survivor raises :class:`~mpicoll.TooFewRanksError`.
        max_np: the most ranks to grow to (default ``MPICOLL_ELASTIC_MAX_NP``, else the
            size the job was launched with, as horovodrun's ``--max-np``).
        discovery: a host discovery command (horovodrun's ``--host-discovery-script``
            format) or a callable returning the slots (default
            ``MPICOLL_ELASTIC_DISCOVERY``; none: the job never grows). See
            :mod:`mpicoll.elastic.discovery`. The same on every rank.
        discovery_interval: seconds between two polls of ``discovery`` (on rank 0, off
            the training thread).
    Raises:
        ValueError: ``min_np`` below 1, a bad ``max_np`` or ``discovery_interval``.
    """
    if not isinstance(min_np, int) or min_np < 1:
        raise ValueError(f"min_np must be an int of at least 1, not {min_np!r}")
    hosts = discovery_module.configure(discovery, max_np, discovery_interval)

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        return run_fn(fn, lambda: world_module.shrink_world(min_np), grow_module.grow_world,
                      hosts)

    return decorate if func is None else decorate(func)
