"""The time model behind ``compression="auto"``: predicted seconds of one compressed
collective for each candidate codec, and the choice (pure functions, no MPI).

Inputs (:class:`ModelInputs`): the link's latency ``alpha`` (seconds per message) and
bandwidth ``beta`` (bytes per second, what one ring step moves while every rank sends at
once), and per codec the cost of one ``encode`` and one ``decode`` of ``b`` bytes of
dense input, ``c0 + b / rate`` (:class:`Speed`), plus the same for one ``numpy.add`` of
``b`` bytes (the reductions and residual subtractions every codec pays).

The compressed all-reduce's schedules (docs/compression.md, *The compressed all-reduce*),
``S`` bytes over ``n`` ranks, block ``S/n`` cut into ``m`` segments of ``q`` bytes
(``segment_bytes``), ``f`` = 1 with error feedback, else 0:

- dense codec (``none``, ``bf16``, ``int8``...): ``2 (n-1) m`` messages of
  ``wire(q)`` bytes, ``n m`` encodes, ``((n-1)(1+f) + n) m`` decodes and
  ``((n-1) + f n) m`` additions of ``q`` bytes;
- sparse codec (``topk``, ``randomk``): ``n - 1`` messages of ``wire(S)`` bytes, one encode
  of ``S``, ``f`` (one decode and one subtraction of ``S``), one zero fill of ``S`` (the
  ``none`` codec's encode, a copy) and ``n`` scatter-adds of ``k`` pairs (costed as
  ``n k / count`` of a decode);
- the node layout (``L`` ranks per node, ``N`` nodes): the flat model on a shard ``S/L``
  among ``N`` nodes with the bandwidth of one of the ``L`` rings that cross at once
  (measured so, or a link's divided by ``L``: :attr:`ModelInputs.per_ring`), plus
  the uncompressed intra-node reduce-scatter and all-gather (the same for every codec):
  ``2 (L-1)`` copies and ``L-1`` additions of ``S/L``;
- reduce-scatter: the dense ring's first phase (``n-1`` steps; no final encode), for
  sparse codecs the sparse model with ``1/n`` of the pairs per message;
  all-gather: ``n-1`` messages of ``wire(S)``, one encode and ``n`` decodes of ``S``.

Communication and computation are added (the ring overlaps them only across segments),
which overestimates both a little; the choice needs the order of the candidates, which
the measurements in docs/results/compression_auto.md check.

:func:`choose` returns the candidate with the least predicted time; ``none`` (the first
candidate) unless another is predicted faster by more than ``margin``. Every input is a
number every rank holds identically (:mod:`.auto` agrees on them first), and the
arithmetic is the same on every rank, so every rank makes the same choice.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from .codecs import Codec, get_codec

__all__ = ["Speed", "ModelInputs", "Choice", "Layout", "predict", "choose",
           "DEFAULT_CANDIDATES"]

#: What ``compression="auto"`` chooses among: no compression first (the default choice).
DEFAULT_CANDIDATES = ("none", "bf16", "int8", "topk:0.01")


@dataclass(frozen=True)
class Speed:
    """Seconds to process ``b`` bytes of dense input: ``overhead + b / rate``.

    Attributes:
        overhead: seconds per call (Python and dispatch), >= 0.
        rate: bytes per second, > 0.
    """

    overhead: float
    rate: float

    def seconds(self, nbytes: float) -> float:
        """Predicted seconds for ``nbytes`` bytes."""
        return self.overhead + nbytes / self.rate


@dataclass(frozen=True)
class ModelInputs:
    """Everything the model needs, identical on every rank.

    Attributes:
        latency: seconds per message on the link (``alpha``).
        bandwidth: bytes per second on the link (``beta``), per ring.
        encode, decode: codec name -> :class:`Speed` of one encode / decode.
        add: :class:`Speed` of one ``numpy.add`` (reductions, residuals).
        source: where the link figures came from (``"measured"``, ``"tuning table
            <path>"``, ``"given"``).
        cpu_share: the least CPU share a rank got while measuring the codecs (already
            applied to their speeds; reported only).
        per_ring: the bandwidth was measured with every ring of the node layout running
            at once (then it is each ring's; otherwise a link's, shared by the ``L`` rings
            that cross it in the node layout).
    """

    latency: float
    bandwidth: float
    encode: Mapping[str, Speed]
    decode: Mapping[str, Speed]
    add: Speed
    source: str = "measured"
    cpu_share: float = 1.0
    per_ring: bool = False

    def as_dict(self) -> dict:
        """Plain numbers, for :func:`~mpicoll.compression.last_stats` and reports."""
        def speeds(table: Mapping[str, Speed]) -> dict:
            return {k: {"overhead_s": v.overhead, "bytes_per_s": v.rate}
                    for k, v in table.items()}
        return {"latency_s": self.latency, "bandwidth_bytes_per_s": self.bandwidth,
                "link_source": self.source, "cpu_share": self.cpu_share,
                "per_ring": self.per_ring,
                "encode": speeds(self.encode),
                "decode": speeds(self.decode),
                "add": {"overhead_s": self.add.overhead, "bytes_per_s": self.add.rate}}


@dataclass(frozen=True)
class Layout:
    """The shape the collective runs in.

    Attributes:
        size: ranks of the communicator (``n``).
        nodes: nodes (``N``; 1 for the flat layout, whatever the machine).
        ranks_per_node: ``L`` (1 for the flat layout).
    """

    size: int
    nodes: int = 1
    ranks_per_node: int = 1


@dataclass
class Choice:
    """What ``compression="auto"`` chose, and why.

    Attributes:
        codec: the chosen codec's name.
        predicted: candidate name -> predicted seconds.
        inputs: the model's inputs (:meth:`ModelInputs.as_dict`).
        reason: one line.
        margin: the margin used.
    """

    codec: str
    predicted: dict[str, float]
    inputs: dict = field(default_factory=dict)
    reason: str = ""
    margin: float = 0.0


def _wire(codec: Codec, nbytes: float, dtype: np.dtype) -> float:
    return float(codec.wire_bytes(int(nbytes) // dtype.itemsize, dtype))


def _speed(table: Mapping[str, Speed], codec: Codec, what: str) -> Speed:
    speed = table.get(codec.name)
    if speed is None:
        raise ValueError(f"compression='auto': no {what} speed for codec {codec.name!r}")
    return speed


def _flat(inp: ModelInputs, codec: Codec, nbytes: float, dtype: np.dtype, n: int,
          seg_bytes: int, feedback: bool, bandwidth: float, collective: str) -> float:
    """Predicted seconds of the flat schedule of ``collective`` over ``n`` ranks."""
    enc, dec = _speed(inp.encode, codec, "encode"), _speed(inp.decode, codec, "decode")
    f = 1 if feedback else 0

    def msgs(count: float, size: float) -> float:
        return count * (inp.latency + size / bandwidth)

    if collective == "allgather":           # nbytes: this rank's block
        return (msgs(n - 1, _wire(codec, nbytes, dtype)) + enc.seconds(nbytes)
                + n * dec.seconds(nbytes) + f * inp.add.seconds(nbytes))
    if not codec.dense:
        count = nbytes / dtype.itemsize
        k = codec.k(int(count)) if count else 0
        fill = _speed(inp.encode, get_codec("none"), "encode").seconds(nbytes)
        pairs = n * (k / count if count else 0.0) * dec.seconds(nbytes)
        wire = _wire(codec, nbytes, dtype)
        if collective == "reduce_scatter":  # each rank gets only its block's pairs
            wire, fill, pairs = wire / n, fill / n, pairs / n
        return (msgs(n - 1, wire) + enc.seconds(nbytes)
                + f * (dec.seconds(nbytes) + inp.add.seconds(nbytes)) + fill + pairs)
    block = nbytes / n
    m = max(1, math.ceil(block / seg_bytes))
    q = block / m
    if collective == "reduce_scatter":
        steps, encodes, decodes = n - 1, (n - 1) * m, (n - 1) * (1 + f) * m
    else:
        steps, encodes, decodes = 2 * (n - 1), n * m, ((n - 1) * (1 + f) + n) * m
    adds = ((n - 1) + f * n) * m
    return (msgs(steps * m, _wire(codec, q, dtype)) + encodes * enc.seconds(q)
            + decodes * dec.seconds(q) + adds * inp.add.seconds(q))


def predict(inputs: ModelInputs, codec: Codec | str, count: int, dtype: Any,
            layout: Layout, seg_bytes: int = 4 << 20, feedback: bool = True,
            collective: str = "allreduce") -> float:
    """Predicted seconds of one compressed ``collective`` of ``count`` elements of
    ``dtype`` with ``codec`` (see the module docstring).

    Args:
        inputs: the model's inputs.
        codec: a codec or its name.
        count: elements of this rank's input (the all-gather: of its block).
        layout: ranks, nodes and ranks per node of the schedule (node layout: ``nodes >
            1`` and ``ranks_per_node > 1``).
        seg_bytes: the schedule's segment size.
        feedback: whether error feedback runs (residual decodes and subtractions).
        collective: ``"allreduce"``, ``"reduce_scatter"`` or ``"allgather"``.
    Returns:
        Seconds (0 for ``count`` 0).
    """
    codec = get_codec(codec)
    dtype = np.dtype(dtype)
    nbytes = float(count) * dtype.itemsize
    if count == 0:
        return 0.0
    fb = feedback and codec.lossy
    L, N = layout.ranks_per_node, layout.nodes
    if collective == "allreduce" and N > 1 and L > 1:
        shard = nbytes / L
        copy = _speed(inputs.encode, get_codec("none"), "encode")
        intra = 2 * (L - 1) * copy.seconds(shard) + (L - 1) * inputs.add.seconds(shard)
        bandwidth = inputs.bandwidth if inputs.per_ring else inputs.bandwidth / L
        return intra + _flat(inputs, codec, shard, dtype, N, seg_bytes, fb, bandwidth,
                             collective)
    if layout.size == 1 and collective == "allreduce":
        enc, dec = _speed(inputs.encode, codec, "encode"), _speed(inputs.decode, codec,
                                                                  "decode")
        return enc.seconds(nbytes) + dec.seconds(nbytes) + (inputs.add.seconds(nbytes)
                                                            if fb else 0.0)
    return _flat(inputs, codec, nbytes, dtype, layout.size, seg_bytes, fb,
                 inputs.bandwidth, collective)


def choose(inputs: ModelInputs, candidates: Sequence[str], count: int, dtype: Any,
           layout: Layout, seg_bytes: int = 4 << 20, feedback: bool = True,
           collective: str = "allreduce", margin: float = 0.0) -> Choice:
    """The candidate with the least predicted time (see :func:`predict`).

    The first candidate (``none`` by default) is kept unless another one is predicted to
    take less than ``(1 - margin)`` of its time; ties go to the earlier candidate.

    Raises:
        ValueError: no candidates, a margin outside [0, 1).
    """
    if not candidates:
        raise ValueError("compression='auto' needs at least one candidate codec")
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"compression='auto': margin must be in [0, 1), got {margin!r}")
    predicted = {c: predict(inputs, c, count, dtype, layout, seg_bytes, feedback, collective)
                 for c in candidates}
    base = candidates[0]
    best = base
    for c in candidates[1:]:
        if predicted[c] < predicted[best] and predicted[c] < (1 - margin) * predicted[base]:
            best = c
    if best == base:
        reason = f"{base}: no candidate is predicted faster"
    else:
        reason = (f"{best}: predicted {predicted[best] * 1e3:.3g} ms against "
                  f"{predicted[base] * 1e3:.3g} ms for {base}")
    return Choice(best, predicted, inputs.as_dict(), reason, margin)
