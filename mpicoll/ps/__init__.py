"""A parameter server over MPI: sharded servers, BSP/ASP/SSP, server-side optimizers.

>>> from mpicoll.ps import ParameterServer
>>> ps = ParameterServer(params, num_servers=1, consistency="bsp", optimizer="sgd", lr=0.1)
>>> if ps.is_server:
...     ps.serve()                   # returns when every worker has closed
... else:
...     w = ps.pull()
...     w = ps.push_pull(grads)      # grads: dict name -> array
...     ps.close()

Modules: :mod:`~mpicoll.ps.protocol` (wire format), :mod:`~mpicoll.ps.placement`,
:mod:`~mpicoll.ps.server`, :mod:`~mpicoll.ps.worker`, :mod:`~mpicoll.ps.optimizers`,
:mod:`~mpicoll.ps.checkpoint`, :mod:`~mpicoll.ps.settings` (the constructor's arguments),
:mod:`~mpicoll.ps.colocated` (``num_servers="colocated"``:
every rank a worker and the server of its shards), :mod:`~mpicoll.ps.compressed` and
:mod:`~mpicoll.ps.colocated_coded` (``compression=``: compressed pushes and pulls with
error feedback), :mod:`~mpicoll.ps.replicas` and :mod:`~mpicoll.ps.replicated`
(``replicas=1``: a primary and a backup server rank per shard, failover under ULFM),
:mod:`~mpicoll.ps.failures` (process failures in the protocol),
:mod:`~mpicoll.ps.node_aggregation` and :mod:`~mpicoll.ps.node_order`
(``local_aggregation=``: the workers of a node push and pull as one; the summation order
every aggregation shares). See docs/ps.md.
"""
from __future__ import annotations

from .core import ParameterServer
from .errors import PSError
from .optimizers import DEFAULTS as HYPERPARAMETERS
from .optimizers import OPTIMIZERS
from .placement import Placement
from .settings import COLOCATED, CONSISTENCY
from .worker import Handle

__all__ = ["ParameterServer", "PSError", "Handle", "Placement", "CONSISTENCY", "COLOCATED",
           "OPTIMIZERS", "HYPERPARAMETERS"]
