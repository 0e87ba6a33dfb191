"""mpicoll: MPI collective communication for distributed deep learning, over mpi4py.

Collectives written by hand over mpi4py point-to-point (ring, recursive doubling,
Rabenseifner, binomial tree, hierarchical, shared memory), with the MPI library's own as
``"native"``:

>>> import numpy as np, mpicoll
>>> x = np.arange(8, dtype=np.float32)
>>> y = mpicoll.allreduce(x, op="sum")                     # any world size
>>> mpicoll.algorithms("allreduce")                        # what algorithm= accepts
['hierarchical', 'native', 'rabenseifner', 'recursive_doubling', 'ring', 'shm', 'tree']

``mpicoll.Comm(MPI.COMM_WORLD)`` is a drop-in mpi4py communicator running these.
Environment variables are listed in :mod:`mpicoll.config`.
"""
from __future__ import annotations

from . import algorithms as _algorithm_modules  # noqa: F401  (registers every algorithm)
from .algorithms.registry import COLLECTIVES
from .algorithms.registry import names as _names
from .buffers import IN_PLACE
from .collectives import (allgather, allreduce, allreduce_init, broadcast, reduce,
                          reduce_scatter)
from .comm import Comm
from .errors import (CollectiveError, CollectiveTimeoutError, HostsUpdatedInterrupt,
                     MismatchError, ProcessFailedError, RemoteError, ResetLimitError,
                     TooFewRanksError)
from .grid import ProcessGrid, process_grid
from .ops import OPS, Op

__version__ = "0.1.0"

__all__ = ["allreduce", "allreduce_init", "reduce_scatter", "allgather", "broadcast", "reduce", "algorithms",
           "Comm", "IN_PLACE", "Op", "OPS", "COLLECTIVES", "CollectiveError", "MismatchError",
           "RemoteError", "ProcessFailedError", "TooFewRanksError", "ResetLimitError", "CollectiveTimeoutError",
           "HostsUpdatedInterrupt",
           "__version__", "ProcessGrid", "process_grid"]


def algorithms(collective: str) -> list[str]:
    """Names accepted by ``algorithm=`` for ``collective`` (besides ``"auto"``).

    Args:
        collective: one of :data:`COLLECTIVES` (``"allreduce"``, ``"reduce_scatter"``,
            ``"allgather"``, ``"broadcast"``, ``"reduce"``).
    Raises:
        ValueError: unknown collective.
    """
    return _names(collective)


def __getattr__(name: str):  # noqa: ANN202
    """``mpicoll.info`` (a callable module: ``mpicoll.info()``) is imported on first use."""
    if name == "info":
        import importlib  # noqa: PLC0415

        return importlib.import_module(".info", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
