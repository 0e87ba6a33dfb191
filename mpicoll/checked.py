"""Checked mode: one tiny collective that proves every rank agrees before the real one.

Each rank contributes a row of integers (its local verdict on its own arguments, then the
collective, count, dtype, op, root and algorithm it asked for, the algorithm ``auto``
resolved to, and its segment size: settings that come from each rank's environment or
tuning file must agree too); one ``MPI_Allgather`` of
those rows on mpicoll's private communicator (on one node, an exchange through the node's
shared window, :func:`mpicoll.node_window.node_table`, whose waits sleep in the kernel)
gives every rank the same table, so every rank reaches the same verdict:

- a rank whose own arguments were bad raises its ``ValueError``/``TypeError``; every other
  rank raises :class:`~mpicoll.errors.RemoteError` naming that rank and its message;
- ranks that disagree raise :class:`~mpicoll.errors.MismatchError` on every rank, saying
  which ranks disagree and how.

Measured cost is in docs/design.md; it is off by default (``MPICOLL_CHECK=1`` or
``check=True`` turn it on).
"""
from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from . import waiting
from .context import CommContext
from .errors import MismatchError, RemoteError
from .node_window import node_table
from .partition import rank_ranges

__all__ = ["agree", "FIELDS"]

#: The columns of the agreement table after the error flag.
FIELDS = ("collective", "count", "dtype", "op", "root", "algorithm", "resolved",
          "segment_bytes")
_UNSET = -1


def _code(value: Any) -> int:
    if value is None:
        return _UNSET
    if isinstance(value, (int, np.integer)):
        return int(value)
    return zlib.crc32(str(value).encode())


def agree(ctx: CommContext, error: BaseException | None, **fields: Any) -> None:
    """Run the agreement step; return normally only if every rank is fine and agrees.

    Args:
        error: this rank's local argument error, or ``None``.
        fields: values for :data:`FIELDS` (missing ones count as unset).
    Raises:
        The local ``error`` on the rank that had it; ``RemoteError`` on the others;
        ``MismatchError`` on every rank when ranks disagree.
    """
    row = [1 if error is not None else 0] + [_code(fields.get(f)) for f in FIELDS]
    window = node_table(ctx)
    if window is not None:
        table = window.exchange(row)
    else:
        gathered = np.empty((ctx.size, len(row)), dtype=np.int64)
        waiting.allgather(ctx.p2p, np.array(row, dtype=np.int64), gathered)
        table = gathered.tolist()
    if any(r[0] for r in table):
        messages = ctx.p2p.allgather(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        bad = {r: m for r, m in enumerate(messages) if m is not None}
        listing = "; ".join(f"rank {r}: {m}" for r, m in bad.items())
        raise RemoteError(f"{fields.get('collective')}: other ranks rejected their arguments "
                          f"({listing})", bad)
    if all(r == row for r in table):
        return
    details = []   # (rows differ past the error flags, all 0: at least one column differs)
    for col, name in enumerate(FIELDS, start=1):
        if any(r[col] != table[0][col] for r in table):
            values = ctx.p2p.allgather(str(fields.get(name)))
            groups: dict[str, list[int]] = {}
            for r, v in enumerate(values):
                groups.setdefault(v, []).append(r)
            details.append(f"{name}: " + ", ".join(f"ranks {rank_ranges(rs)} have {v}"
                                                   for v, rs in groups.items()))
    raise MismatchError(f"{fields.get('collective')}: ranks disagree: " + "; ".join(details),
                        details)

