"""Shared data and the one-process reference of the compressed all-reduce MPI suite.

The reference replays the algorithm's arithmetic on every rank's (gathered) input with the
same codec, written independently of mpicoll.compression.allreduce: for each block ``b``
(``numpy.array_split`` of the vector into ``n`` blocks) and each segment of it, rank ``b``
encodes its compensated input, then ranks ``b+1, b+2, ...`` each decode, add their own
input and re-encode; the last encoding (by rank ``b - 1``) is the block's value, decoded.
Every encoding's loss is that rank's new residual for those elements. Sparse codecs: every
rank's payload decoded and added into zeros in rank order.
"""
from __future__ import annotations

import math

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


def reference(spec: str, inputs: list[np.ndarray], residuals: list[np.ndarray | None],
              segment_bytes: int | None, randomk_step: int = 0
              ) -> tuple[np.ndarray, list[np.ndarray]]:
    """(result, new residuals) of the compressed all-reduce of ``inputs`` (sum)."""
    n = len(inputs)
    count = inputs[0].size
    dtype = inputs[0].dtype
    y = [x + r if r is not None else x.copy() for x, r in zip(inputs, residuals, strict=True)]
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
                     segment_bytes: int | None, randomk_step: int = 0
                     ) -> tuple[np.ndarray, list[np.ndarray]]:
    """:func:`reference` computed once, on rank 0, and broadcast (keeps the suite fast at
    8 ranks on 2 cores)."""
    ref = None
    if RANK == 0:
        ref = reference(spec, inputs, residuals, segment_bytes, randomk_step)
    return COMM.bcast(ref, root=0)
