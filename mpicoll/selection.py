"""``algorithm="auto"``: choose an algorithm from (collective, world size, ranks per node,
message size).

The choice depends only on values every rank has (the collective, the communicator's
size and layout, the message's byte count), so every rank makes the same one.
``MPICOLL_ALGORITHM`` forces a name wherever it is registered for the collective.
"""
from __future__ import annotations

from . import config
from .algorithms.registry import names

__all__ = ["choose", "resolve_algorithm"]

KiB = 1024


def _is_power_of_two(n: int) -> bool:
    return n & (n - 1) == 0


def choose(collective: str, size: int, ranks_per_node: int, nbytes: int) -> str:
    """The algorithm ``auto`` uses for ``nbytes`` (the full vector) over ``size`` ranks."""
    forced = config.env_str("MPICOLL_ALGORITHM")
    if forced and forced != "auto" and forced in names(collective):
        return forced
    if collective == "allreduce":
        if nbytes <= 4 * KiB:
            return "recursive_doubling"
        if nbytes <= 512 * KiB or (_is_power_of_two(size) and nbytes <= 4096 * KiB):
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
                      nbytes: int) -> str:
    """Validate ``algorithm`` and resolve ``"auto"``.

    Raises:
        TypeError: ``algorithm`` is not a string.
        ValueError: not a registered name (the message lists the choices).
    """
    if not isinstance(algorithm, str):
        raise TypeError(f"algorithm must be a string, not {type(algorithm).__name__}")
    if algorithm == "auto":
        return choose(collective, size, ranks_per_node, nbytes)
    if algorithm not in names(collective):
        raise ValueError(f"unknown algorithm={algorithm!r} for {collective}; choose one of "
                         f"{['auto', *names(collective)]}")
    return algorithm
