"""``algorithm="auto"``: choose an algorithm from (collective, world size, ranks per node,
message size).

The choice depends only on values every rank has (the collective, the communicator's
size and layout, the message's byte count) and on the tuning table, which every rank reads
from the same file, so every rank makes the same one. In order:

1. ``MPICOLL_ALGORITHM`` forces a name wherever it is registered for the collective;
2. the active tuning table (:mod:`mpicoll.tuning`: :func:`mpicoll.tuning.use_table`,
   ``MPICOLL_TUNING_FILE`` or the shipped default), when it has an entry for this
   collective and world size naming a registered algorithm;
3. the built-in rules below (:func:`builtin_choice`).
"""
from __future__ import annotations

from typing import Any

from . import config, tuning
from .algorithms.allreduce_hierarchical import cross_node_message
from .algorithms.registry import is_registered, names
from .context import CommContext
from .partition import is_power_of_two

__all__ = ["choose", "builtin_choice", "resolve_algorithm", "inner_allreduce",
           "algorithm_options"]

KiB = 1024


def choose(collective: str, size: int, ranks_per_node: int, nbytes: int) -> str:
    """The algorithm ``auto`` uses for ``nbytes`` (the full vector) over ``size`` ranks.

    Raises:
        ValueError: ``MPICOLL_TUNING_FILE`` names a missing or invalid table.
    """
    forced = config.env_str("MPICOLL_ALGORITHM")
    if forced and forced != "auto" and is_registered(collective, forced):
        return forced
    table = tuning.active_table()
    if table is not None:
        name = table.lookup(collective, size, ranks_per_node, nbytes)
        if name is not None and is_registered(collective, name):
            return name
    return builtin_choice(collective, size, ranks_per_node, nbytes)


def builtin_choice(collective: str, size: int, ranks_per_node: int, nbytes: int) -> str:
    """The built-in rules, used where no tuning table has an entry.

    An all-reduce over several nodes (rules from the namespace test bed at 1 Gbit/s,
    docs/cluster.md): recursive doubling up to 64 KiB with several ranks per node (128 KiB
    with one), where latency rules; above, with several ranks per node, ``hierarchical``,
    which sends each byte across the network once per node instead of once per rank
    (1.37-1.40x faster than ring at 16-64 MiB on 2 nodes x 2 ranks, 1.16-1.40x than MPI);
    with one rank per node, ``ring``, which puts 2(n-1)/n of the vector on each link, the
    least any all-reduce can (4 nodes x 1: within 2% of that bound at 64 MiB, 1.15-1.23x
    faster than MPI from 8 MiB up).
    """
    if collective == "allreduce":
        if 0 < ranks_per_node < size:  # several nodes (docs/cluster.md)
            if ranks_per_node == 1:
                return "recursive_doubling" if nbytes <= 128 * KiB else "ring"
            return "recursive_doubling" if nbytes <= 64 * KiB else "hierarchical"
        if nbytes <= 4 * KiB:
            return "recursive_doubling"
        if nbytes <= 512 * KiB or (is_power_of_two(size) and nbytes <= 4096 * KiB):
            return "rabenseifner"
        return "ring"
    if collective == "reduce_scatter":
        return "recursive_halving" if nbytes <= 64 * KiB * size else "ring"
    if collective == "allgather":
        return "recursive_doubling" if nbytes <= 64 * KiB else "ring"
    if collective == "broadcast":
        return "binomial" if nbytes <= 64 * KiB or size <= 2 else "scatter_allgather"
    return "binomial"


def resolve_algorithm(collective: str, algorithm: str, size: int, ranks_per_node: int,
                      nbytes: int, host: bool = True) -> str:
    """Validate ``algorithm`` and resolve ``"auto"`` (never to ``shm``, which works on host
    buffers only, where ``host`` is false: device buffers on a CUDA-aware MPI).

    Raises:
        TypeError: ``algorithm`` is not a string.
        ValueError: not a registered name (the message lists the choices).
    """
    if not isinstance(algorithm, str):
        raise TypeError(f"algorithm must be a string, not {type(algorithm).__name__}")
    if algorithm == "auto":
        name = choose(collective, size, ranks_per_node, nbytes)
        return name if host or name != "shm" else \
            builtin_choice(collective, size, ranks_per_node, nbytes)
    if not is_registered(collective, algorithm):
        raise ValueError(f"unknown algorithm={algorithm!r} for {collective}; choose one of "
                         f"{['auto', *names(collective)]}")
    return algorithm


def inner_allreduce(ctx: CommContext, count: int, itemsize: int) -> str:
    """The all-reduce ``hierarchical`` (and ``shm``) runs among nodes for ``count`` items.

    Chosen like ``auto`` for the shard this rank reduces across nodes, with one rank per
    node (never ``hierarchical`` itself); every rank of that cross-node all-reduce has the
    same shard size and so makes the same choice.
    """
    nbytes, ranks = cross_node_message(ctx, count, itemsize)
    name = choose("allreduce", ranks, 1, nbytes)
    return "rabenseifner" if name in ("hierarchical", "shm") else name


def algorithm_options(collective: str, name: str, ctx: CommContext, flat: Any) -> dict:
    """Keyword arguments algorithm ``name`` needs besides its buffers (chosen here, when
    a call is planned, so that algorithms never call back into selection)."""
    if collective == "allreduce" and name in ("hierarchical", "shm"):
        return {"inner": inner_allreduce(ctx, flat.size, flat.dtype.itemsize)}
    return {}
