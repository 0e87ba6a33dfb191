"""What the latest compressed collective of this thread sent: :func:`last_stats`.

One record type for every compressed collective (all-reduce, reduce-scatter, all-gather):
:class:`CollectiveStats`, also importable as ``AllreduceStats`` (its name before the
reduce-scatter and all-gather existed; the fields it had are unchanged).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["CollectiveStats", "AllreduceStats", "last_stats", "record", "fill"]


@dataclass
class CollectiveStats:
    """What one compressed collective sent from this rank.

    Attributes:
        codec: the codec's name.
        count, dtype, size: elements of this rank's input (``sendbuf``: the whole vector
            for the all-reduce and the reduce-scatter, this rank's block for the
            all-gather), input dtype, world size.
        layout: ``"flat"`` or ``"node"`` (what the all-reduce's ``layout=`` resolved to;
            the reduce-scatter and the all-gather are always ``"flat"``).
        bytes_sent: payload bytes this rank sent (every phase):
            ``intra_node_bytes + inter_node_bytes``.
        intra_node_bytes: the part sent to ranks on this rank's node (uncompressed in the
            node layout).
        inter_node_bytes: the part sent to ranks on other nodes.
        messages: messages this rank sent.
        dense_bytes: bytes the same schedule sends uncompressed (ring all-reduce:
            ``2 (n-1)/n`` of the vector, for sparse codecs an uncompressed ring all-reduce;
            in the node layout the intra-node phases plus that of the shard among nodes;
            reduce-scatter: the uncompressed ring reduce-scatter, every block but this
            rank's; all-gather: the uncompressed ring all-gather, ``n - 1`` blocks).
        collective: ``"allreduce"``, ``"reduce_scatter"`` or ``"allgather"``.
        choice: with ``compression="auto"``, the
            :class:`~mpicoll.compression.cost_model.Choice`: the chosen codec (also in
            ``codec``), the predicted seconds of every candidate, the model's inputs
            (latency, bandwidth, codec speeds) and the reason; ``None`` otherwise.
    """

    codec: str
    count: int
    dtype: str
    size: int
    layout: str = "flat"
    bytes_sent: int = 0
    intra_node_bytes: int = 0
    inter_node_bytes: int = 0
    messages: int = 0
    dense_bytes: int = 0
    collective: str = "allreduce"
    choice: Any = None

    @property
    def ratio(self) -> float:
        """``dense_bytes / bytes_sent`` (how many times fewer bytes; 1.0 if nothing sent)."""
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else 1.0


#: The all-reduce's name for :class:`CollectiveStats`.
AllreduceStats = CollectiveStats

_local = threading.local()


def last_stats() -> CollectiveStats | None:
    """Statistics of this thread's latest compressed collective (``None`` before any)."""
    return getattr(_local, "stats", None)


def record(stats: CollectiveStats) -> CollectiveStats:
    """Make ``stats`` what :func:`last_stats` returns in this thread; return it."""
    _local.stats = stats
    return stats


def fill(stats: CollectiveStats, intra: tuple, inter: tuple) -> None:
    """Fill ``stats`` from what a rank sent inside its node and to other nodes (each a
    ``ring.Sent``: bytes, messages, dense bytes)."""
    stats.bytes_sent = intra[0] + inter[0]
    stats.messages = intra[1] + inter[1]
    stats.dense_bytes = intra[2] + inter[2]
    stats.intra_node_bytes, stats.inter_node_bytes = intra[0], inter[0]
