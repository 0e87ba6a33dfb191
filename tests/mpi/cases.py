"""Shared test data and references for the MPI suites.

Data depends on rank, element index and repetition, and is chosen so that every order of
reduction gives the same exact result (small integers; powers of two for products), so
results compare exactly with a reference computed independently: every rank's input
(generated again here, :func:`all_inputs`, or for other data gathered with mpi4py's
pickle-based allgather, :func:`gather_inputs`) reduced with numpy in rank order. Each
rank compares its result's bits with the reference (:func:`bits_equal`), so the replicas
are bit-identical without a message.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

import mpicoll

COMM = MPI.COMM_WORLD
RANK = COMM.Get_rank()
SIZE = COMM.Get_size()

#: Element counts every collective is tried with: 0, 1, n-1, n, n+1, a prime > n, and a
#: prime that crosses many segments at the small segment size the tests set (211 int8s are
#: 4 segments of 64 bytes, 211 complex128s 53).
COUNTS = sorted({0, 1, max(SIZE - 1, 0), SIZE, SIZE + 1, 13, 211})

#: Segment size (bytes) the suites run with, so multi-segment paths are reached.
SMALL_SEGMENT = 64

#: The in-place forms are size-independent code paths (the plan copies or aliases the
#: buffers the same way at every size): tested at n = 1, 2 and 3 (one node, two nodes of
#: one, uneven nodes of 2 and 1 with the shared-memory all-reduce in many chunks); at
#: n = 4, 5 and 8 only the out-of-place forms run, which halves those runs of the CI
#: suite (2 cores).
IN_PLACE_FORMS = (False, True) if SIZE <= 3 else (False,)

ALL_DTYPES = [np.int8, np.uint16, np.int32, np.int64, np.uint64, np.float16, np.float32,
              np.float64, np.complex64, np.complex128, np.bool_]
MOVE_DTYPES = [np.int8, np.float16, np.float64, np.complex64, np.bool_]


def applicable(op: str, dtype: type) -> bool:
    """Whether ``op`` applies to ``dtype`` (mirrors mpicoll.ops kinds)."""
    kind = np.dtype(dtype).kind
    return kind in mpicoll.OPS[op].kinds


def make_data(rank: int, count: int, rep: int, dtype: type, op: str = "sum") -> np.ndarray:
    """Rank-, index- and repetition-dependent data whose reductions are exact."""
    idx = np.arange(count, dtype=np.int64)
    base = (idx * 7 + rank * 13 + rep * 5) % 11  # 0..10
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return ((idx + rank + rep) % 3 == 0)
    if op == "prod":
        # values in {1, 2} (or {0.5, 1, 2} for floats): exact in any order
        vals = 1 + (base % 2)
        if dt.kind in "fc":
            return np.where(base % 3 == 0, 0.5, vals).astype(dt)
        return vals.astype(dt)
    if dt.kind == "u":
        out = base.astype(dt)
    else:
        out = (base - 5).astype(dt)
    if dt.kind == "c":
        out = out + 1j * ((idx + 3 * rank + rep) % 5 - 2).astype(dt)
    return out.astype(dt)


def gather_inputs(local: np.ndarray) -> list[np.ndarray]:
    """Every rank's input, in rank order (independent of mpicoll)."""
    return COMM.allgather(local)


def all_inputs(count: int, rep: int, dtype: type, op: str = "sum") -> list[np.ndarray]:
    """Every rank's :func:`make_data`, in rank order, computed here: the reference needs no
    message (each one costs a synchronisation of oversubscribed ranks in CI)."""
    return [make_data(r, count, rep, dtype, op) for r in range(SIZE)]


def reference_reduce(inputs: list[np.ndarray], op: str) -> np.ndarray:
    """Reduce ``inputs`` with numpy, in rank order; average divides at the end."""
    o = mpicoll.OPS[op]
    acc = inputs[0].copy()
    for x in inputs[1:]:
        getattr(np, o.ufunc)(acc, x, out=acc)
    o.finalize(acc, len(inputs))
    return acc


def bits_equal(got: np.ndarray, expected: np.ndarray) -> bool:
    """Whether ``got`` holds exactly ``expected``'s bits (dtype, size and bytes).

    With exact test data every correct algorithm gives the reference's bits, so when every
    rank checks this against the same reference the replicas are bit-identical too, with
    no message (:func:`same_on_all_ranks` costs an all-gather per check).
    """
    return (got.dtype == expected.dtype and got.size == expected.size
            and np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(expected).tobytes())


def same_on_all_ranks(result: np.ndarray) -> bool:
    """Whether ``result`` is bit-identical on every rank."""
    mine = np.ascontiguousarray(result).view(np.uint8).tobytes()
    return all(r == mine for r in COMM.allgather(mine))


def describe(**fields: object) -> str:
    return ", ".join(f"{k}={v}" for k, v in fields.items())
