"""The adapter's ``MPICOLL_*`` environment variables (read once, by :func:`init`).

================================== ========================================================
Variable                           Meaning
================================== ========================================================
``MPICOLL_FUSION_THRESHOLD``       Largest fused all-reduce buffer, in bytes (default
                                   64 MiB; ``0`` turns fusion off: one all-reduce per tensor).
``MPICOLL_CYCLE_TIME_MS``          Shortest time between two negotiation rounds, in
                                   milliseconds (default 0.5): requests arriving within one
                                   cycle are negotiated, and fused, together.
``MPICOLL_ALLREDUCE_ALGORITHM``    mpicoll all-reduce algorithm for tensors (default
                                   ``auto``; any name of ``mpicoll.algorithms("allreduce")``).
``MPICOLL_STALL_CHECK_TIME_SECONDS`` Log (rank 0) the requests that some ranks submitted and
                                   others did not after this many seconds (default 60;
                                   ``0`` disables the inspector).
``MPICOLL_OVERLAP``                ``1``: negotiate and reduce as soon as requests arrive
                                   (communication overlaps backward); ``0``: start a round
                                   only once this rank's user thread waits for a result (or
                                   50 ms after the latest request), so collectives
                                   never compete with computation for a core; ``auto``
                                   (default): ``1`` when the node has a spare core per rank
                                   (cores >= ranks on the node x (torch threads + 1)).
================================== ========================================================
"""
from __future__ import annotations

from dataclasses import dataclass

from ... import config
from ...algorithms.registry import names

__all__ = ["Settings", "from_environment", "allreduce_algorithm"]

DEFAULT_FUSION_THRESHOLD = 64 << 20


@dataclass(frozen=True)
class Settings:
    """The engine's configuration."""

    fusion_threshold: int = DEFAULT_FUSION_THRESHOLD
    cycle_time: float = 0.0005
    algorithm: str = "auto"
    stall_check_time: float = 60.0
    overlap: str = "auto"


def allreduce_algorithm() -> str:
    """``MPICOLL_ALLREDUCE_ALGORITHM`` (as last read by :mod:`mpicoll.config`), else ``"auto"``.

    Raises:
        ValueError: not ``auto`` nor a name of ``mpicoll.algorithms("allreduce")``.
    """
    algorithm = config.env_str("MPICOLL_ALLREDUCE_ALGORITHM") or "auto"
    if algorithm != "auto" and algorithm not in names("allreduce"):
        raise ValueError(f"MPICOLL_ALLREDUCE_ALGORITHM={algorithm!r}; choose one of "
                         f"{['auto', *names('allreduce')]}")
    return algorithm


def from_environment() -> Settings:
    """Read the variables above, afresh (:func:`mpicoll.config.refresh`).

    Raises:
        ValueError: a malformed value, or an unknown algorithm name.
    """
    config.refresh()
    algorithm = allreduce_algorithm()
    overlap = (config.env_str("MPICOLL_OVERLAP") or "auto").lower()
    if overlap not in ("auto", "0", "1"):
        raise ValueError(f"MPICOLL_OVERLAP={overlap!r}; use auto, 1 or 0")
    return Settings(
        fusion_threshold=config.env_int("MPICOLL_FUSION_THRESHOLD", DEFAULT_FUSION_THRESHOLD,
                                        minimum=0),
        cycle_time=config.env_float("MPICOLL_CYCLE_TIME_MS", 0.5, minimum=0) / 1000.0,
        algorithm=algorithm,
        stall_check_time=config.env_float("MPICOLL_STALL_CHECK_TIME_SECONDS", 60.0,
                                          minimum=0),
        overlap=overlap,
    )
