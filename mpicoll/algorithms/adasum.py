"""Adasum (Horovod's ``op=hvd.Adasum``): pairwise adaptive summation of float vectors.

Not a registered all-reduce (its reduction is not element-wise, and a fused buffer holds
several tensors, each with its own dot products): :mod:`mpicoll.torch` runs it on its
fused buffers.

Two gradients ``a`` and ``b`` combine as::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a coefficient is 1 when its vector's squared norm is below ``sqrt(DBL_MIN)``, Horovod
0.28's guard), so orthogonal gradients add and equal ones average. Over ``p = 2^k`` ranks
the gradients combine in a binary tree of rank blocks: at level ``l = 1, 2, 4, ...`` the
result of ranks ``[j, j + l)`` combines with that of ``[j + l, j + 2l)`` (``j`` a multiple
of ``2l``), the lower block as ``a``. Dot products and norms are per tensor (each request of
a fused buffer has its own), computed in float64.

As in Horovod's CPU path (``AdasumMPIAllreduceOp``, ``Adasum::FusedAllreduce``), the tree
runs as vector-halving, distance-doubling: at level ``l`` each rank exchanges half of the
range it holds with rank ``rank ^ l``, computes the partial dot products and norms of its
half, sums them over its block of ``2l`` ranks (recursive doubling on 3 doubles per tensor,
the same sums on every rank of the block), and combines its half in place (in float64,
rounded to the buffer's dtype after every level, as Horovod does); the halves then travel
back in reverse order. Every rank ends with the same buffer.

World sizes that are not a power of two raise :class:`AdasumUnsupportedError`, as
Horovod's CPU Adasum does (``NotImplementedError`` there; ours is also a ``ValueError``).

The messages are point-to-point on the adapter's private communicator (``engine.comm``),
sent only by the engine thread, with tags of their own.
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from .. import waiting
from ..buffers import msg

__all__ = ["AdasumUnsupportedError", "check_adasum_size", "adasum_allreduce", "adasum_pair"]

log = logging.getLogger("mpicoll.algorithms.adasum")

#: Squared norms below this leave their vector's coefficient at 1 (Horovod 0.28's guard).
NORM_GUARD = float(np.sqrt(sys.float_info.min))

_TAG_HALVES = 0x4144          # vector halves, both directions
_TAG_SUMS = 0x4145            # per-tensor dot products and norms


class AdasumUnsupportedError(NotImplementedError, ValueError):
    """Adasum cannot run here: a world (or process set) size that is not a power of two.

    A ``NotImplementedError``, as Horovod raises, and a ``ValueError`` (a bad argument for
    this world size), so either ``except`` catches it."""


def check_adasum_size(size: int) -> None:
    """Raise :class:`AdasumUnsupportedError` unless ``size`` ranks can run Adasum.

    Args:
        size: ranks taking part (the world or the process set).
    """
    if size < 1 or size & (size - 1):
        raise AdasumUnsupportedError(
            f"Running Adasum with non-power of 2 ranks is not supported yet (as in Horovod): "
            f"{size} ranks take part; use 1, 2, 4, 8, ... ranks or a process set of such a "
            f"size")


def adasum_pair(a: np.ndarray, b: np.ndarray, dot: float, a_norm2: float,
                b_norm2: float) -> np.ndarray:
    """``a`` and ``b`` combined with Horovod's coefficients, in float64.

    Args:
        a, b: equal-length slices of the two vectors. dot, a_norm2, b_norm2: the dot
            product and squared norms of the *whole* vectors.
    Returns:
        ``ca * a + cb * b`` as a new float64 array.
    """
    ca = 1.0 - dot / a_norm2 * 0.5 if a_norm2 >= NORM_GUARD else 1.0
    cb = 1.0 - dot / b_norm2 * 0.5 if b_norm2 >= NORM_GUARD else 1.0
    return ca * a.astype(np.float64) + cb * b.astype(np.float64)


def _partial_sums(mine: np.ndarray, theirs: np.ndarray, lo: int,
                  bounds: Sequence[tuple[int, int]], left: bool) -> np.ndarray:
    """Per tensor: (dot, |lower block's part|^2, |upper block's part|^2) of the range
    ``[lo, lo + len(mine))`` (zeros for tensors outside it)."""
    sums = np.zeros((len(bounds), 3), dtype=np.float64)
    hi = lo + mine.size
    for i, (start, end) in enumerate(bounds):
        s, e = max(start, lo), min(end, hi)
        if s >= e:
            continue
        a = mine[s - lo:e - lo].astype(np.float64)
        b = theirs[s - lo:e - lo].astype(np.float64)
        own, other = float(a @ a), float(b @ b)
        sums[i] = (float(a @ b), own, other) if left else (float(a @ b), other, own)
    return sums


def _block_sum(comm: MPI.Intracomm, rank: int, level: int, sums: np.ndarray) -> np.ndarray:
    """Sum ``sums`` over the block of ``2 * level`` ranks around ``rank`` (recursive
    doubling: each step adds two equal-shape arrays, so every rank gets the same bits)."""
    incoming = np.empty_like(sums)
    bit = 1
    while bit <= level:
        partner = rank ^ bit
        waiting.sendrecv(comm, msg(sums), partner, _TAG_SUMS, msg(incoming), partner,
                         _TAG_SUMS)
        sums = sums + incoming
        bit <<= 1
    return sums


def adasum_allreduce(buf: np.ndarray, counts: Sequence[int], comm: MPI.Intracomm) -> None:
    """Reduce ``buf`` over ``comm`` with Adasum, in place (every rank ends with the result).

    Args:
        buf: flat, contiguous, floating (the fused buffer of one or more tensors, the same
            layout on every rank).
        counts: elements of each tensor, in buffer order (``sum(counts) == buf.size``);
            dot products and norms are per tensor.
        comm: the communicator (its size a power of two). Called by every rank of it with
            the same ``counts``.
    Raises:
        AdasumUnsupportedError: ``comm``'s size is not a power of two (on every rank,
            before any message).
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    check_adasum_size(size)
    n = buf.size
    if size == 1 or n == 0:
        return
    bounds, offset = [], 0
    for count in counts:
        bounds.append((offset, offset + int(count)))
        offset += int(count)
    if offset != n:
        raise ValueError(f"counts sum to {offset}, the buffer has {n} elements")
    scratch = np.empty(n - n // 2, dtype=buf.dtype)
    lo, hi = 0, n
    ranges = []                                   # (lo, hi) held before each halving
    level = 1
    while level < size:
        partner = rank ^ level
        mid = lo + (hi - lo) // 2
        left = not rank & level
        keep, give = ((lo, mid), (mid, hi)) if left else ((mid, hi), (lo, mid))
        theirs = scratch[:keep[1] - keep[0]]
        waiting.sendrecv(comm, msg(buf[give[0]:give[1]]), partner, _TAG_HALVES,
                         msg(theirs), partner, _TAG_HALVES)
        ranges.append((lo, hi))
        lo, hi = keep
        mine = buf[lo:hi]
        sums = _block_sum(comm, rank, level, _partial_sums(mine, theirs, lo, bounds, left))
        for i, (start, end) in enumerate(bounds):
            s, e = max(start, lo), min(end, hi)
            if s >= e:
                continue
            dot, lower, upper = sums[i]
            own, other = (lower, upper) if left else (upper, lower)
            mine[s - lo:e - lo] = adasum_pair(mine[s - lo:e - lo], theirs[s - lo:e - lo],
                                              dot, own, other)
        level <<= 1
    while ranges:
        level >>= 1
        partner = rank ^ level
        plo, phi = ranges.pop()
        missing = (hi, phi) if not rank & level else (plo, lo)
        waiting.sendrecv(comm, msg(buf[lo:hi]), partner, _TAG_HALVES,
                         msg(buf[missing[0]:missing[1]]), partner, _TAG_HALVES)
        lo, hi = plo, phi
