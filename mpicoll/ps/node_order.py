"""The order in which a parameter server sums contributions: node by node.

Floating-point sums depend on their order, so every aggregation of the parameter server
(separate servers, co-located owners, with or without local aggregation) uses one defined
order: the contributions are grouped by node (nodes in the node layout's order, the ranks of
a node in rank order), each node's group is summed left to right, and the node sums are
summed left to right. With every contributor on one node (or one per node) this is plain
rank order. A node that aggregates locally (:mod:`mpicoll.ps.node_aggregation`) computes
its node sum with the same left fold (:func:`fold_sum` on its leader), so the server's result is the same bits whether it received the node's
workers one by one or the node's sum once.

The divisor of ``average`` is the number of *workers* a sum holds: a node's push counts
as its number of workers (its *weight*).
"""
from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

__all__ = ["grouped_order", "fold_sum", "total_weight"]


def grouped_order(contributors: Sequence[int], node_of: dict[int, int] | Sequence[int] | None
                  ) -> tuple[list[int], list[int]]:
    """Sort ``contributors`` node by node.

    Args:
        contributors: ranks (or keys) that contributed.
        node_of: each contributor's node index (``None``: every contributor its own node).
    Returns:
        ``(order, sizes)``: the contributors sorted by (node, rank), and how many of them
        each node holds, in that order.
    """
    if node_of is None:
        order = sorted(contributors)
        return order, [1] * len(order)
    order = sorted(contributors, key=lambda r: (node_of[r], r))
    return order, [len(list(g)) for _, g in itertools.groupby(order, lambda r: node_of[r])]


def fold_sum(out: np.ndarray, parts: Sequence[np.ndarray], sizes: Sequence[int],
             tmp: np.ndarray | None = None) -> np.ndarray:
    """``out = sum(parts)`` node by node: each group of ``sizes`` consecutive parts summed
    left to right, then the group sums left to right (the order of the module docstring).

    Args:
        out: the result; may be ``parts[0]`` itself (summed in place).
        parts: the contributions, grouped by node (:func:`grouped_order`).
        sizes: how many parts each node holds (summing to ``len(parts)``).
        tmp: scratch for the sum of a later node holding several parts; ``None``: the
            parts are writable and such a node is summed into its own first part.
    Returns:
        ``out``.
    """
    start = 0
    for k, n in enumerate(sizes):
        group = parts[start:start + n]
        start += n
        if k == 0:
            _sum_into(out, group)
        elif n == 1:
            out += group[0]
        else:
            out += _sum_into(group[0] if tmp is None else tmp, group)
    return out


def _sum_into(dest: np.ndarray, group: Sequence[np.ndarray]) -> np.ndarray:
    """``dest`` = ``group`` summed left to right (``dest`` may be ``group[0]``)."""
    if len(group) == 1:
        if group[0] is not dest:
            np.copyto(dest, group[0])
        return dest
    np.add(group[0], group[1], out=dest)
    for p in group[2:]:
        dest += p
    return dest


def total_weight(contributors: Sequence[int], weights: dict[int, int] | Sequence[int] | None
                 ) -> int:
    """How many workers the contributions of ``contributors`` hold (``None``: one each)."""
    if weights is None:
        return len(contributors)
    return sum(int(weights[r]) for r in contributors)
