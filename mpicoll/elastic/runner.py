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
4. on :class:`~mpicoll.HostsUpdatedInterrupt`: reset and go on, synchronising unless the
   interrupt says it may be skipped.

Other exceptions propagate. Without ULFM (``mpirun --with-ft ulfm`` with Open MPI) a
process failure ends the job as it would without this module.
"""
from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable

from mpi4py import MPI

from .. import faults
from ..errors import HostsUpdatedInterrupt, ProcessFailedError
from . import shrink as world_module
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
        except ProcessFailedError as exc:
            log.warning("another failure while resetting (%s); shrinking again", exc)
        except MPI.Exception as exc:
            if not faults.is_process_failure(exc):
                raise
            log.warning("another failure while resetting (%s); shrinking again", exc)
    raise RuntimeError(f"the world kept failing: {MAX_RESETS_PER_FAILURE} resets in a row")


def run_fn(func: Callable[..., Any], reset: Callable[[], Any]) -> Callable[..., Any]:
    """``func(state, ...)`` made elastic, with ``reset()`` rebuilding the world (see the
    module's docstring)."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, State):
            raise TypeError(f"the first argument of an elastic function must be a "
                            f"mpicoll.elastic.State, not {type(state).__name__}")
        load_from_disk(state)
        skip_sync = False
        recovery = None
        while True:
            try:
                if not skip_sync:
                    began = time.perf_counter()
                    state.sync()
                    if recovery is not None:
                        recovery.phases["sync"] = time.perf_counter() - began
                return func(state, *args, **kwargs)
            except ProcessFailedError as exc:
                if not faults.ENABLED:
                    raise
                detected_at = time.time()
                failed_at = time.perf_counter()
                log.warning("process failure (%s): restoring the last commit and "
                            "shrinking", exc)
                state.restore()
                restored = time.perf_counter()
                skip_sync = False
            except HostsUpdatedInterrupt as exc:
                skip_sync = exc.skip_sync
                detected_at = time.time()
                failed_at = restored = time.perf_counter()
            _reset_until_stable(reset)
            reset_done = time.perf_counter()
            state.on_reset()
            recovery = world_module.last_recovery
            if recovery is not None:
                recovery.detected_at = detected_at
                recovery.phases.update(restore=restored - failed_at,
                                       reset=reset_done - restored,
                                       callbacks=time.perf_counter() - reset_done)

    return wrapper


def run(func: Callable[..., Any] | None = None, *, min_np: int = 1) -> Callable[..., Any]:
    """Decorator: ``func(state, ...)`` goes on after a process failure on the survivors
    (numpy programs: the reset shrinks the world that mpicoll's ``comm=None`` means).

    ``@mpicoll.elastic.run`` or ``@mpicoll.elastic.run(min_np=3)``.

    Args:
        func: the training function; its first argument is a
            :class:`~mpicoll.elastic.State`.
        min_np: the least number of ranks to go on with (default 1); below it every
            survivor raises :class:`~mpicoll.TooFewRanksError`.
    Raises:
        ValueError: ``min_np`` below 1.
    """
    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        return run_fn(fn, lambda: world_module.shrink_world(min_np))

    if not isinstance(min_np, int) or min_np < 1:
        raise ValueError(f"min_np must be an int of at least 1, not {min_np!r}")

    return decorate if func is None else decorate(func)
