"""Training that goes on when a rank or node dies (issue 24).

Under Open MPI with ULFM (``mpirun --with-ft ulfm``) the survivors shrink and continue in
memory; under MPI libraries without ULFM, ``python -m mpicoll.elastic.launch`` relaunches
the job from the last commit written to disk. For numpy programs::

    import mpicoll, mpicoll.elastic as elastic

    state = elastic.ObjectState(step=0, weights=np.zeros(10))

    @elastic.run(min_np=2)
    def train(state):
        while state.step < 100:
            grad = ...                                   # this rank's gradient
            state.weights -= 0.1 * mpicoll.allreduce(grad, op="average")   # comm=None
            state.step += 1
            state.commit()

    train(state)

``comm=None`` (every mpicoll collective's default) means :func:`world`, which is
``MPI.COMM_WORLD`` until a failure and the survivors' communicator after it (or the grown
world, after new processes joined: ``run(discovery=..., max_np=...)``,
:mod:`mpicoll.elastic.grow`). See docs/elastic.md. :mod:`mpicoll.torch.elastic` is
Horovod's ``hvd.elastic``.
"""
from __future__ import annotations

from ..errors import (HostsUpdatedInterrupt, ProcessFailedError, ResetLimitError,
                      TooFewRanksError)
from . import grow as _grow
from . import shrink as _shrink
from .discovery import DiscoveryError, HostsAddedInterrupt
from .grow import Growth, GrowthError, grow_world
from .runner import run, run_fn
from .state import HostUpdateResult, ObjectState, State, broadcast_object
from .shrink import Recovery, shrink_world, world

__all__ = ["run", "run_fn", "State", "ObjectState", "HostUpdateResult", "broadcast_object",
           "world",
           "shrink_world", "Recovery", "last_recovery", "ProcessFailedError",
           "TooFewRanksError", "ResetLimitError", "HostsUpdatedInterrupt", "HostsAddedInterrupt",
           "DiscoveryError", "grow_world", "Growth", "GrowthError", "last_growth", "joined"]


def joined() -> bool:
    """Whether this process was started by a growth and joined a running job."""
    return _grow.joined is not None


def last_growth() -> Growth | None:
    """The latest growth this process took part in, with its phases' durations
    (``None``: none)."""
    return _grow.last_growth


def last_recovery() -> Recovery | None:
    """The latest recovery of this process, with its phases' durations (``None``: none)."""
    return _shrink.last_recovery
