"""Shrinking the world after a process failure (ULFM): revoke, agree, shrink, switch.

:func:`shrink_world` is what every survivor runs once a collective has raised
:class:`~mpicoll.ProcessFailedError`:

1. *revoke* the current world and every communicator mpicoll holds for it
   (:func:`mpicoll.runtime.failures.fail_world`), so that a survivor still blocked in a
   call on them (waiting on another survivor) wakes with an error and comes here too;
2. *agree and shrink*: ``MPI_Comm_shrink`` (ULFM) is a fault-tolerant agreement on the set
   of failed processes and returns the communicator of the survivors, the same on every
   one of them; the failed ranks are those of the old world missing from it;
3. *switch*: make the survivors' communicator the runtime's next world, what ``comm=None``
   means (:func:`mpicoll.context.set_world`); the old world's communicators are forgotten,
   never freed (a collective free would wait for the dead). Per-communicator
   state (private duplicate, node layout, shared-memory windows, tuning layout, stall
   inspector) is built again on the new world's first collective, as for any new
   communicator.

Below ``min_np`` survivors every survivor raises :class:`~mpicoll.TooFewRanksError`
(they all see the same shrunken size, so none waits for another).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from mpi4py import MPI

from .. import context
from ..errors import TooFewRanksError
from ..runtime import comms, failures
from ..runtime import world as runtime_world

__all__ = ["Recovery", "shrink_world", "last_recovery", "world", "survivors"]

log = logging.getLogger("mpicoll.elastic")

world = context.world


@dataclass
class Recovery:
    """What one :func:`shrink_world` did, with its phases' durations in seconds.

    Attributes:
        failed: the ranks of the old world that failed (agreed by every survivor).
        old_size, new_size: the world's size before and after. rank: this rank after.
        revoke_s: revoking the old world's communicators. shrink_s: ``MPI_Comm_shrink``
            (the agreement included). switch_s: switching the world.
        phases: further phases recorded by the callers, in seconds: ``restore`` (the
            last commit), ``reset`` (all of the reset: for ``hvd.elastic`` also
            ``abandon``, the old engine, and ``init``, the new one), ``callbacks``,
            ``sync`` (the state from the new rank 0).
        detected_at: when (``time.time()``) this rank caught the failure's error.
    """

    failed: list[int]
    old_size: int
    new_size: int
    rank: int
    revoke_s: float
    shrink_s: float
    switch_s: float
    phases: dict[str, float] = field(default_factory=dict)
    detected_at: float = 0.0

    def summary(self) -> str:
        """``revoke=0.0001,shrink=0.0020,...``: every phase, in seconds."""
        phases = {"revoke": self.revoke_s, "shrink": self.shrink_s, **self.phases}
        return ",".join(f"{name}={seconds:.4f}" for name, seconds in phases.items())


#: The latest recovery of this process (``None``: none yet).
last_recovery: Recovery | None = None


def survivors(old: MPI.Intracomm | MPI.Group, members: list[int],
              new: MPI.Intracomm) -> list[int]:
    """The ranks of ``new`` of those of ``members`` (ranks of ``old``, a communicator or
    its group) that are in it, in order."""
    old_group = old if isinstance(old, MPI.Group) else old.Get_group()
    new_group = new.Get_group()
    try:
        moved = MPI.Group.Translate_ranks(old_group, members, new_group)
    finally:
        if old_group is not old:
            old_group.Free()
        new_group.Free()
    return [r for r in moved if r != MPI.UNDEFINED]


def shrink_world(min_np: int = 1) -> Recovery:
    """Replace the world by its survivors (collective over the survivors of the current
    world; see the module's docstring).

    Args:
        min_np: the least number of ranks the job goes on with.
    Returns:
        The :class:`Recovery` (also kept as :data:`last_recovery`).
    Raises:
        RuntimeError: ULFM is not available and on (the job cannot shrink).
        TooFewRanksError: fewer than ``min_np`` ranks survived (on every survivor; the
            survivors' communicator is the world by then, so the ranks can still end
            together).
    """
    global last_recovery
    if not failures.ENABLED:
        raise RuntimeError("shrinking after a failure needs ULFM: Open MPI launched with "
                           "'mpirun --with-ft ulfm' (see docs/elastic.md)")
    old = context.world()
    start = time.perf_counter()
    failures.fail_world(old, [])
    revoked = time.perf_counter()
    plain = old if type(old) is MPI.Intracomm else MPI.Intracomm(old)
    new = comms.shrink(plain)
    shrunk = time.perf_counter()
    kept = survivors(new, list(range(new.Get_size())), plain)   # as ranks of the old world
    failed = sorted(set(range(plain.Get_size())) - set(kept))     # the old ranks missing
    runtime_world.mark_failed(runtime_world.generation(), failed)   # the agreed ranks
    context.set_world(new)
    done = time.perf_counter()
    last_recovery = Recovery(failed, plain.Get_size(), new.Get_size(), new.Get_rank(),
                             revoked - start, shrunk - revoked, done - shrunk)
    log.warning("rank %d of the old world, %d of the new: world shrank from %d to %d ranks "
                "(failed: old ranks %s; revoke %.3f s, shrink %.3f s)", plain.Get_rank(),
                new.Get_rank(), plain.Get_size(), new.Get_size(), failed, revoked - start,
                shrunk - revoked)
    if new.Get_size() < min_np:
        raise TooFewRanksError(
            f"only {new.Get_size()} rank(s) survived the failure of rank(s) {failed} (of "
            f"{plain.Get_size()}), fewer than min_np={min_np}: the job stops",
            new.Get_size(), min_np, failed)
    return last_recovery
