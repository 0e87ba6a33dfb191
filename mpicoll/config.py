"""Every ``MPICOLL_*`` environment variable, in one place.

Keyword arguments always win; these variables only supply defaults where a launcher makes
arguments awkward. Each is read on first use and cached; :func:`refresh` re-reads them.

============================== ============================================================
Variable                       Meaning
============================== ============================================================
``MPICOLL_CHECK``              ``1`` runs the agreement check before every collective (see
                               :mod:`mpicoll.checked`); ``0`` (default) skips it.
``MPICOLL_SEGMENT_BYTES``      Largest message of a segmented algorithm (ring, tree,
                               pipelined broadcast), in bytes. Default 1 MiB.
``MPICOLL_RANKS_PER_NODE``     Emulate nodes of this many consecutive ranks (the last node
                               may hold fewer), instead of the real shared-memory nodes.
``MPICOLL_TUNING_FILE``        JSON tuning table used by ``algorithm="auto"``.
``MPICOLL_ALGORITHM``          Force one algorithm name wherever ``"auto"`` is asked for
                               (a name not registered for a collective is ignored there).
============================== ============================================================

The PyTorch adapter adds ``MPICOLL_FUSION_THRESHOLD``, ``MPICOLL_CYCLE_TIME_MS``,
``MPICOLL_ALLREDUCE_ALGORITHM``, ``MPICOLL_STALL_CHECK_TIME_SECONDS`` and
``MPICOLL_OVERLAP``, read by ``mpicoll.torch.init()``: see :mod:`mpicoll.torch.settings`
(their descriptions are merged into :data:`VARIABLES` below).
"""
from __future__ import annotations

import os
from typing import Any, Callable

__all__ = ["refresh", "env_bool", "env_int", "env_float", "env_str", "segment_bytes",
           "check_enabled", "VARIABLES"]

VARIABLES = {
    "MPICOLL_CHECK": "run the cross-rank agreement check before each collective (0/1)",
    "MPICOLL_SEGMENT_BYTES": "largest segment of segmented algorithms in bytes (default 1 MiB)",
    "MPICOLL_RANKS_PER_NODE": "emulate nodes of this many consecutive ranks",
    "MPICOLL_TUNING_FILE": "JSON tuning table for algorithm='auto'",
    "MPICOLL_ALGORITHM": "force an algorithm where 'auto' is asked for",
    # read by mpicoll.torch.init() (mpicoll/torch/settings.py has the details)
    "MPICOLL_FUSION_THRESHOLD": "mpicoll.torch: largest fused all-reduce buffer in bytes",
    "MPICOLL_CYCLE_TIME_MS": "mpicoll.torch: shortest time between negotiation rounds (ms)",
    "MPICOLL_ALLREDUCE_ALGORITHM": "mpicoll.torch: all-reduce algorithm for gradients",
    "MPICOLL_STALL_CHECK_TIME_SECONDS": "mpicoll.torch: stall inspector warning delay (s)",
    "MPICOLL_OVERLAP": "mpicoll.torch: overlap communication with backward (auto/1/0)",
}

DEFAULT_SEGMENT_BYTES = 1 << 20


_cache: dict[str, str | None] = {}


def refresh() -> None:
    """Forget cached values: the next read of each variable looks at the environment again.

    Values are cached on first read (reading ``os.environ`` costs about a microsecond, too
    much on every collective call); call this after changing a variable at run time.
    """
    from . import fastpath  # noqa: PLC0415  (cached calls hold algorithm choices)

    _cache.clear()
    fastpath.invalidate()


def env_str(name: str, default: str | None = None) -> str | None:
    """Return the variable's value (cached, see :func:`refresh`), or ``default`` if unset."""
    try:
        value = _cache[name]
    except KeyError:
        raw = os.environ.get(name, "")
        value = _cache[name] = raw if raw.strip() else None
    return default if value is None else value


def _env_number(name: str, default: Any, minimum: Any, parse: Callable[[str], Any],
                what: str) -> Any:
    raw = env_str(name)
    if raw is None:
        return default
    try:
        value = parse(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not {what}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value


def env_int(name: str, default: int, minimum: int | None = None) -> int:
    """Return the variable as an int.

    Raises:
        ValueError: the value is not an integer or is below ``minimum``.
    """
    return _env_number(name, default, minimum, int, "an integer")


def env_float(name: str, default: float, minimum: float | None = None) -> float:
    """Return the variable as a float.

    Raises:
        ValueError: the value is not a number or is below ``minimum``.
    """
    return _env_number(name, default, minimum, float, "a number")


def env_bool(name: str, default: bool) -> bool:
    """Return the variable as a bool (1/0, true/false, yes/no, on/off)."""
    raw = env_str(name)
    if raw is None:
        return default
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean (use 1 or 0)")


def segment_bytes() -> int:
    """Segment size of segmented algorithms, in bytes (``MPICOLL_SEGMENT_BYTES``)."""
    return env_int("MPICOLL_SEGMENT_BYTES", DEFAULT_SEGMENT_BYTES, minimum=1)


def check_enabled() -> bool:
    """Whether collectives run the agreement check by default (``MPICOLL_CHECK``)."""
    return env_bool("MPICOLL_CHECK", False)
