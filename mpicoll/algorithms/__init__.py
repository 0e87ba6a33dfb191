"""Algorithm modules, one per collective and algorithm (``<collective>_<algorithm>.py``,
named as registered); importing this registers them all.

Shared message schedules live in :mod:`.ring_schedule`, :mod:`.halving_doubling_schedule`
and :mod:`.binomial_schedule`; cached plans in :mod:`.plans`; the name registry in
:mod:`.registry`.
"""
from . import (  # noqa: F401  (each import registers its algorithm)
    allgather_recursive_doubling,
    allgather_ring,
    allreduce_hierarchical,
    allreduce_rabenseifner,
    allreduce_recursive_doubling,
    allreduce_ring,
    allreduce_shm,
    allreduce_tree,
    broadcast_binomial,
    broadcast_scatter_allgather,
    native,
    reduce_binomial,
    reduce_scatter_recursive_halving,
    reduce_scatter_ring,
)
