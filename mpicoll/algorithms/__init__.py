"""Algorithm modules, one per collective and algorithm; importing this registers them all.

Shared schedules live in :mod:`.ring`, :mod:`.halving_doubling` and :mod:`.binomial`;
cached plans in :mod:`.plans`; the name registry in :mod:`.registry`.
"""
from . import (  # noqa: F401  (each import registers its algorithm)
    allgather_recursive_doubling,
    allgather_ring,
    allreduce_hierarchical,
    allreduce_rabenseifner,
    allreduce_recursive_doubling,
    allreduce_ring,
    allreduce_tree,
    bcast_binomial,
    bcast_scatter_allgather,
    native,
    reduce_binomial,
    reduce_scatter_halving,
    reduce_scatter_ring,
)
