"""Shared data and the one-process reference of the compressed all-reduce MPI suite.

The reference replays the algorithm's arithmetic on every rank's (gathered) input with the
same codec, written independently of mpicoll.compression.allreduce.

Flat layout: for each block ``b`` (``numpy.array_split`` of the vector into ``n`` blocks)
and each segment of it, rank ``b`` encodes its compensated input, then ranks ``b+1, b+2,
...`` each decode, add their own input and re-encode; the last encoding (by rank ``b - 1``)
is the block's value, decoded. Every encoding's loss is that rank's new residual for those
elements. Sparse codecs: every rank's payload decoded and added into zeros in rank order.

Node layout (nodes from ``MPICOLL_RANKS_PER_NODE``, else one node: this machine): nodes of
``L`` ranks each sum shard ``i`` (``array_split`` into ``L``) exactly, in the order of a ring
reduce-scatter ending at local rank ``i`` (``y[i+1] + y[i+2] + ... + y[i]``), and the flat
replay runs on each shard over those node sums, its residuals going to local rank ``i`` of
each node; nodes of different sizes sum the whole vector in binomial-tree order (a rank
adds its children's subtree sums, nearest child first) and the flat replay runs over the
node sums, its residuals going to each node's first rank. Every other residual is zero.
"""
from __future__ import annotations

import math
import os

import numpy as np
from mpi4py import MPI

from mpicoll.compression import get_codec

COMM = MPI.COMM_WORLD
RANK = COMM.Get_rank()
SIZE = COMM.Get_size()

#: 0, 1, n-1, n, n+1, primes larger than n, and one crossing many small segments.
COUNTS = sorted({0, 1, max(SIZE - 1, 0), SIZE, SIZE + 1, 13, 1009})

DEFAULT_SEGMENT = 4 << 20


def make_input(rank: int, count: int, rep: int, dtype) -> np.ndarray:
    """Rank-, index- and repetition-dependent floats (different on every rank)."""
    rng = np.random.default_rng([rank, count, rep, 12345])
    idx = np.arange(count)
    return (rng.standard_normal(count) * (1 + rank) + np.sin(idx + rank * 3 + rep)).astype(dtype)


def split_bounds(count: int, parts: int) -> list[int]:
    sizes = [len(a) for a in np.array_split(np.empty(count), parts)]
    return [0] + list(np.cumsum(sizes))


def node_sizes(n: int) -> list[int]:
    """The nodes the library sees at ``n`` ranks: emulated ones, else this one machine."""
    per = int(os.environ.get("MPICOLL_RANKS_PER_NODE", "0") or 0)
    if per <= 0:
        return [n]
    return [min(per, n - first) for first in range(0, n, per)]


def resolved_layout(n: int, layout: str = "auto") -> str:
    """What ``layout`` means at ``n`` ranks: ``node`` for ``auto`` with several nodes and
    some node of more than one rank."""
    if layout != "auto":
        return layout
    sizes = node_sizes(n)
    return "node" if len(sizes) > 1 and max(sizes) > 1 else "flat"


def reference(spec: str, inputs: list[np.ndarray], residuals: list[np.ndarray | None],
              segment_bytes: int | None, randomk_step: int = 0, layout: str = "auto"
              ) -> tuple[np.ndarray, list[np.ndarray]]:
    """(result, new residuals) of the compressed all-reduce of ``inputs`` (sum)."""
    y = [x + r if r is not None else x.copy() for x, r in zip(inputs, residuals, strict=True)]
    if resolved_layout(len(inputs), layout) == "node":
        return node_reference(spec, y, segment_bytes, randomk_step)
    return flat_reference(spec, y, segment_bytes, randomk_step)


def _tree_sum(ys: list[np.ndarray], v: int = 0) -> np.ndarray:
    """Binomial-tree sum of ``ys`` at relative rank ``v``: own + children nearest first."""
    acc = ys[v].copy()
    low = v & -v if v else 1 << max(0, (len(ys) - 1).bit_length())
    step = 1
    while step < low and v + step < len(ys):
        acc = acc + _tree_sum(ys, v + step)
        step <<= 1
    return acc


def node_reference(spec: str, y: list[np.ndarray], segment_bytes: int | None,
                   randomk_step: int = 0) -> tuple[np.ndarray, list[np.ndarray]]:
    """The node layout's (result, new residuals) from the compensated inputs ``y``."""
    n, count, dtype = len(y), y[0].size, y[0].dtype
    sizes = node_sizes(n)
    firsts = [sum(sizes[:k]) for k in range(len(sizes))]
    new_res = [np.zeros(count, dtype) for _ in range(n)]
    if len(set(sizes)) > 1:  # uneven: whole vector through each node's first rank
        sums = [_tree_sum(y[f:f + size]) for f, size in zip(firsts, sizes, strict=True)]
        result, res = flat_reference(spec, sums, segment_bytes, randomk_step)
        for f, r in zip(firsts, res, strict=True):
            new_res[f] = r
        return result, new_res
    local = sizes[0]
    shards = split_bounds(count, local)
    result = np.zeros(count, dtype)
    for i in range(local):
        lo, hi = shards[i], shards[i + 1]
        sums = []
        for f in firsts:
            acc = y[f + (i + 1) % local][lo:hi].copy()
            for t in range(2, local + 1):
                acc = acc + y[f + (i + t) % local][lo:hi]
            sums.append(acc)
        result[lo:hi], res = flat_reference(spec, sums, segment_bytes, randomk_step)
        for f, r in zip(firsts, res, strict=True):
            new_res[f + i][lo:hi] = r
    return result, new_res


def flat_reference(spec: str, y: list[np.ndarray], segment_bytes: int | None,
                   randomk_step: int = 0) -> tuple[np.ndarray, list[np.ndarray]]:
    """The flat layout's (result, new residuals) from the compensated inputs ``y``."""
    n = len(y)
    count = y[0].size
    dtype = y[0].dtype
    new_res = [np.zeros(count, dtype) for _ in range(n)]
    result = np.zeros(count, dtype)
    codec = get_codec(spec)
    if count == 0:
        return result, new_res
    if not codec.dense:
        for q in range(n):
            c = get_codec(spec)
            if hasattr(c, "step"):
                c.step = randomk_step
            sent = c.decode(c.encode(y[q]), count, dtype)
            new_res[q] = y[q] - sent
        # sum in rank order, each rank's (index, value) pairs added into zeros
        for q in range(n):
            c = get_codec(spec)
            if hasattr(c, "step"):
                c.step = randomk_step
            idx, vals = c.indices_values(c.encode(y[q]))
            result[idx] += vals
        return result, new_res
    seg = DEFAULT_SEGMENT if segment_bytes is None else segment_bytes
    per = max(1, seg // dtype.itemsize)
    bb = split_bounds(count, n)
    nseg = max(1, math.ceil(max(bb[i + 1] - bb[i] for i in range(n)) / per))
    for b in range(n):
        sb = [bb[b] + o for o in split_bounds(bb[b + 1] - bb[b], nseg)]
        for j in range(nseg):
            lo, hi = sb[j], sb[j + 1]
            dec = None
            for step in range(n):
                q = (b + step) % n
                acc = y[q][lo:hi].copy() if dec is None else dec + y[q][lo:hi]
                dec = codec.decode(codec.encode(acc), hi - lo, dtype)
                new_res[q][lo:hi] = acc - dec
            result[lo:hi] = dec
    return result, new_res


def gather(a: np.ndarray) -> list[np.ndarray]:
    """Every rank's array, in rank order (mpi4py pickle allgather, independent of mpicoll)."""
    return COMM.allgather(a)


def shared_reference(spec: str, inputs: list[np.ndarray], residuals: list[np.ndarray | None],
                     segment_bytes: int | None, randomk_step: int = 0, layout: str = "auto"
                     ) -> tuple[np.ndarray, list[np.ndarray]]:
    """:func:`reference` computed once, on rank 0, and broadcast (keeps the suite fast at
    8 ranks on 2 cores)."""
    ref = None
    if RANK == 0:
        ref = reference(spec, inputs, residuals, segment_bytes, randomk_step, layout)
    return COMM.bcast(ref, root=0)


# ---------------------------------------------------------------------------------------
# the compressed reduce-scatter and all-gather

def block_segments(count: int, n: int, b: int, segment_bytes: int | None, dtype) -> list[int]:
    """Bounds of the segments of block ``b`` in the dense ring (every block is cut into as
    many segments as the largest needs)."""
    seg = DEFAULT_SEGMENT if segment_bytes is None else segment_bytes
    per = max(1, seg // np.dtype(dtype).itemsize)
    bb = split_bounds(count, n)
    nseg = max(1, math.ceil(max(bb[i + 1] - bb[i] for i in range(n)) / per))
    return [bb[b] + o for o in split_bounds(bb[b + 1] - bb[b], nseg)]


def reduce_scatter_reference(spec: str, inputs: list[np.ndarray],
                             residuals: list[np.ndarray | None], segment_bytes: int | None,
                             call: int = 0) -> tuple[np.ndarray, list[np.ndarray]]:
    """(the whole reduced vector, new residuals) of the compressed reduce-scatter (sum).

    Dense: each segment of block ``b`` is encoded first by rank ``b + 1`` from its input,
    then decoded, added and re-encoded by ranks ``b + 2, ...``; the owner ``b`` adds its
    input to the last decoded sum and keeps it as it is (its residual there is zero).
    Sparse: every rank ``q != b`` encodes block ``b`` on its own (random-k at step
    ``call * n + b``); the owner adds the pairs into zeros in rank order, its own values
    at its own turn.
    """
    y = [x + r if r is not None else x.copy() for x, r in zip(inputs, residuals, strict=True)]
    n, count, dtype = len(y), y[0].size, y[0].dtype
    new_res = [np.zeros(count, dtype) for _ in range(n)]
    result = np.zeros(count, dtype)
    codec = get_codec(spec)
    bb = split_bounds(count, n)
    for b in range(n):
        if codec.dense:
            sb = block_segments(count, n, b, segment_bytes, dtype)
            for j in range(len(sb) - 1):
                lo, hi = sb[j], sb[j + 1]
                dec = None
                for step in range(n):
                    q = (b + 1 + step) % n
                    acc = y[q][lo:hi].copy() if dec is None else dec + y[q][lo:hi]
                    if step == n - 1:
                        result[lo:hi] = acc
                        break
                    dec = codec.decode(codec.encode(acc), hi - lo, dtype)
                    new_res[q][lo:hi] = acc - dec
            continue
        lo, hi = bb[b], bb[b + 1]
        block = np.zeros(hi - lo, dtype)
        for q in range(n):
            if q == b:
                block = block + y[q][lo:hi]
                continue
            c = get_codec(spec)
            if hasattr(c, "step"):
                c.step = call * n + b
            payload = c.encode(y[q][lo:hi])
            new_res[q][lo:hi] = y[q][lo:hi] - c.decode(payload, hi - lo, dtype)
            idx, vals = c.indices_values(payload)
            block[idx] += vals
        result[lo:hi] = block
    return result, new_res


def allgather_reference(spec: str, inputs: list[np.ndarray],
                        residuals: list[np.ndarray | None], call: int = 0
                        ) -> tuple[np.ndarray, list[np.ndarray]]:
    """(the gathered vector, new residuals) of the compressed all-gather: every block is
    its owner's (compensated) block encoded once and decoded."""
    y = [x + r if r is not None else x.copy() for x, r in zip(inputs, residuals, strict=True)]
    blocks, new_res = [], []
    for q in range(len(y)):
        c = get_codec(spec)
        if hasattr(c, "step"):
            c.step = call
        dec = c.decode(c.encode(y[q]), y[q].size, y[q].dtype)
        blocks.append(dec)
        new_res.append(y[q] - dec)
    return np.concatenate(blocks), new_res


def on_rank0(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` computed on rank 0 and broadcast."""
    return COMM.bcast(fn(*args, **kwargs) if RANK == 0 else None, root=0)


def check_feedback_conserves_the_total(call, calls: int, count: int = 1009) -> None:
    """Over ``calls`` calls with one ErrorFeedback: summed over ranks, the residuals plus
    the whole result equal the sum of the compensated inputs (float64, up to rounding).

    Args:
        call: ``call(x, fb) -> the whole result`` (the same on every rank).
    """
    from mpicoll.compression import ErrorFeedback  # noqa: PLC0415

    fb = ErrorFeedback()
    old = np.zeros(count)
    for rep in range(calls):
        x = make_input(RANK, count, rep, np.float32)
        y = x.astype(np.float64) + old
        result = call(x, fb)
        res = fb.residual().astype(np.float64)
        total_y = np.sum(gather(y), axis=0)
        total_res = np.sum(gather(res), axis=0)
        scale = np.abs(total_y).max() + 1
        np.testing.assert_allclose(result + total_res, total_y, rtol=0, atol=1e-5 * scale)
        old = res
