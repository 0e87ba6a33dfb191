"""Horovod's elastic API for ``mpicoll.torch`` (``hvd.elastic``), over Open MPI's ULFM.

::

    import mpicoll.torch as hvd

    hvd.init()
    sampler = hvd.elastic.ElasticSampler(dataset)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch, (x, y) in enumerate(loader, start=state.batch):
                ...                                    # forward, backward, step
                state.sampler.record_batch(state.batch, batch_size)
                state.commit()
            state.batch = 0
            state.sampler.set_epoch(state.epoch + 1)

    train(state)

When a rank dies (``mpirun --with-ft ulfm``), every survivor's pending operation raises
``hvd.HorovodInternalError`` (a :class:`mpicoll.ProcessFailedError`); :func:`run` then
restores the last commit, abandons the engine, shrinks the world to the survivors
(:func:`mpicoll.elastic.shrink_world`), starts the engine again on it (``hvd.size()`` and
``hvd.rank()`` change; the global process set follows; other process sets are dropped
and must be added again in a reset callback), calls the reset callbacks, synchronises
the state from rank 0 and runs the function again.

With ``@hvd.elastic.run(discovery=..., max_np=...)`` the job also grows (Horovod's "hosts
added"): when discovery reports more slots, the next ``state.commit()`` raises
``HostsUpdatedInterrupt`` on every rank (the state is not rolled back), the engine is shut
down, new processes of the same program are spawned and merged into the world
(:mod:`mpicoll.elastic.grow`), the engine starts on it, the reset callbacks run and the
new ranks receive the state in the sync. A new process joins when it imports
``mpicoll.torch``; its ``hvd.init()`` starts its engine on the grown world. See
docs/elastic.md.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable

from ...elastic import DiscoveryError, joined, last_growth, last_recovery
from ...elastic import shrink as _shrink
from ...elastic.discovery import DEFAULT_INTERVAL_S
from ...elastic.discovery import configure as configure_discovery
from ...elastic.grow import GrowthError
from ...elastic.grow import facts as grow_facts
from ...elastic.grow import grow_world as _grow_world
from ...elastic.runner import limits, run_fn
from ...elastic.state import HostUpdateResult, ObjectState, State
from ...errors import HostsUpdatedInterrupt, ProcessFailedError, TooFewRanksError
from .. import state as _torch_state
from ..distributed.reconfigure import follow_world, remade_before_callbacks
from .sampler import ElasticSampler
from .state import TorchState

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler", "HostUpdateResult",
           "HorovodInternalError", "HostsUpdatedInterrupt", "TooFewRanksError", "DiscoveryError",
           "last_recovery", "last_growth", "joined"]

#: Horovod's name for the failure that :func:`run` recovers from (restore the last commit,
#: reset, go on): a rank lost, :class:`mpicoll.ProcessFailedError`. Mismatches, bad
#: arguments, too few ranks and another rank's shutdown are not: they are
#: :class:`mpicoll.CollectiveError` (or ``ValueError``) and end the training function.
HorovodInternalError = ProcessFailedError


def _reset(min_np: int) -> None:
    """Abandon the engine, shrink the world to the survivors, start the engine on it (if
    ``hvd.init()`` had started one: a torch.distributed program needs none) and rebuild
    the "mpicoll" process groups on it."""
    began = time.perf_counter()
    engine = _torch_state.started()
    _torch_state.abandon("a process failed; mpicoll.torch is resetting on the survivors")
    abandoned = time.perf_counter()
    recovery = _shrink.shrink_world(min_np)
    shrunk = time.perf_counter()
    if engine:
        _torch_state.init()
    started = time.perf_counter()
    follow_world()
    recovery.phases.update(abandon=abandoned - began, init=started - shrunk,
                           groups=time.perf_counter() - started)


def _grow(new_size: int) -> None:
    """Stop the engine (a shutdown round of the running ranks), grow the world, start
    the engine on it (the new ranks start theirs in their own ``hvd.init()``) and rebuild
    the "mpicoll" process groups on it, before the engine where the program made them
    first (whatever the state: an ``ObjectState`` too); when the new processes cannot
    start, the engine starts again on the unchanged world."""
    began = time.perf_counter()
    engine = _torch_state.started()
    if engine:
        _torch_state.shutdown()
    stopped = time.perf_counter()
    grow_facts["remade"] = remade_before_callbacks(engine)   # (for the new processes)
    try:
        growth = _grow_world(new_size)
    except GrowthError:
        if engine:
            _torch_state.init()          # the world is unchanged: the engine again on it
        raise
    grown = time.perf_counter()
    # the process groups and the engine on the grown world, in the order the program made
    # them (the new processes run it from its top: they make them in that order)
    groups_first = not engine or _torch_state.started_after_groups()
    if groups_first:
        follow_world()
    if engine:
        _torch_state.init()
    if not groups_first:
        follow_world()
    growth.phases.update(shutdown=stopped - began, init=time.perf_counter() - grown)


def run(func: Callable[..., Any] | None = None, *, min_np: int | None = None,
        max_np: int | None = None, discovery: Any = None,
        discovery_interval: float = DEFAULT_INTERVAL_S,
        reset_limit: int | None = None) -> Callable[..., Any]:
    """Decorator (Horovod's ``hvd.elastic.run``): ``func(state, ...)`` goes on after a
    process failure on the survivors, and grows when ``discovery`` reports room for more
    ranks (see the module's docstring).

    ``@hvd.elastic.run``, ``@hvd.elastic.run(min_np=2)``,
    ``@hvd.elastic.run(discovery="./discover.sh", max_np=8)``.

    Args:
        func: the training function; its first argument is a :class:`State`.
        min_np: the least number of ranks to go on with (horovodrun's ``--min-np``;
            default ``MPICOLL_ELASTIC_MIN_NP``, else 1); below it every survivor raises
            :class:`TooFewRanksError`.
        max_np: the most ranks to grow to (horovodrun's ``--max-np``; default
            ``MPICOLL_ELASTIC_MAX_NP``, else the size the job was launched with).
        discovery: horovodrun's ``--host-discovery-script`` (a command), or a callable
            returning the slots (default ``MPICOLL_ELASTIC_DISCOVERY``; none: the job
            never grows). The same on every rank.
        discovery_interval: seconds between two polls of ``discovery`` (rank 0).
        reset_limit: the most resets (shrinks and growths) the job goes through
            (horovodrun's ``--reset-limit``; default ``MPICOLL_ELASTIC_RESET_LIMIT``,
            else no limit); the next raises
            :class:`~mpicoll.ResetLimitError` on every rank.
    Raises:
        ValueError: ``min_np`` below 1, a bad ``max_np``, ``discovery_interval`` or
            ``reset_limit``.
    """
    min_np, reset_limit = limits(min_np, reset_limit)
    hosts = configure_discovery(discovery, max_np, discovery_interval)

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        return run_fn(fn, functools.partial(_reset, min_np), _grow, hosts, reset_limit,
                      min_np)

    return decorate if func is None else decorate(func)
