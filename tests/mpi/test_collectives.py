"""reduce_scatter, allgather, broadcast and reduce: every algorithm x dtype x count, twice."""
from __future__ import annotations

import numpy as np
import pytest

import mpicoll

from cases import (ALL_DTYPES, COMM, COUNTS, IN_PLACE_FORMS, MOVE_DTYPES, RANK, SIZE,
                   all_inputs, applicable, bits_equal, describe, make_data,
                   reference_reduce)

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("segment")]

RED_OPS = ["sum", "max", "average", "bxor"]


def _fail(errors, **case):
    return [describe(**case) + ": " + "; ".join(errors)] if errors else []


@pytest.mark.parametrize("algorithm", mpicoll.algorithms("reduce_scatter") + ["auto"])
def test_reduce_scatter(algorithm):
    failures = []
    for op in RED_OPS:
        for dtype in [d for d in ALL_DTYPES if applicable(op, d)]:
            for count in COUNTS:
                mine = np.array_split(np.arange(count), SIZE)[RANK]
                for in_place in IN_PLACE_FORMS:
                    out = np.empty(mine.size, dtype=dtype)
                    full = np.empty(count, dtype=dtype)
                    for rep in range(2):
                        data = make_data(RANK, count, rep, dtype, op)
                        expected = reference_reduce(all_inputs(count, rep, dtype, op), op)[mine]
                        if in_place:
                            full[...] = data
                            got = mpicoll.reduce_scatter(mpicoll.IN_PLACE, full, op=op,
                                                         algorithm=algorithm)
                        else:
                            got = mpicoll.reduce_scatter(data, out, op=op, algorithm=algorithm)
                        errors = [] if bits_equal(got, expected) else [
                            f"got {got[:6]} expected {expected[:6]}"]
                        failures += _fail(errors, op=op, dtype=np.dtype(dtype).name,
                                          count=count, in_place=in_place, rep=rep)
    assert not failures, "\n".join(failures[:10])


@pytest.mark.parametrize("algorithm", mpicoll.algorithms("allgather") + ["auto"])
def test_allgather(algorithm):
    failures = []
    for dtype in MOVE_DTYPES:
        for count in COUNTS:
            for in_place in IN_PLACE_FORMS:
                out = np.empty(count * SIZE, dtype=dtype)
                for rep in range(2):
                    data = make_data(RANK, count, rep, dtype)
                    expected = np.concatenate(all_inputs(count, rep, dtype))
                    if in_place:
                        out[...] = 0
                        out[RANK * count:(RANK + 1) * count] = data
                        got = mpicoll.allgather(mpicoll.IN_PLACE, out, algorithm=algorithm)
                    else:
                        got = mpicoll.allgather(data, out, algorithm=algorithm)
                    errors = [] if bits_equal(got, expected) else ["wrong result"]
                    failures += _fail(errors, dtype=np.dtype(dtype).name, count=count,
                                      in_place=in_place, rep=rep)
    assert not failures, "\n".join(failures[:10])


def test_allgather_allocates_concatenated_shape():
    x = np.full((2, 3), RANK, dtype=np.int32)
    y = mpicoll.allgather(x)
    assert y.shape == (2 * SIZE, 3)
    np.testing.assert_array_equal(y[:, 0], np.repeat(np.arange(SIZE), 2))


def test_allgather_of_fortran_ordered_blocks_keeps_their_rows():
    """A Fortran-ordered block: the new result's rows are each rank's rows in rank order
    (they were its memory in Fortran order: scrambled), on every call (not a cached copy)."""
    x = np.asfortranarray(np.arange(6).reshape(2, 3) + 10 * RANK)
    for rep in range(3):   # the same array, changed in place
        y = mpicoll.allgather(x)
        expected = [np.arange(6).reshape(2, 3) + 10 * r + rep for r in range(SIZE)]
        np.testing.assert_array_equal(y, np.concatenate(expected))
        x += 1


@pytest.mark.parametrize("algorithm", mpicoll.algorithms("broadcast") + ["auto"])
def test_broadcast(algorithm):
    failures = []
    for dtype in MOVE_DTYPES:
        for count in COUNTS:
            buf = np.empty(count, dtype=dtype)
            for root in sorted({0, SIZE - 1, SIZE // 2}):
                for rep in range(2):
                    buf[...] = make_data(RANK, count, rep, dtype)
                    expected = make_data(root, count, rep, dtype)
                    got = mpicoll.broadcast(buf, root=root, algorithm=algorithm)
                    errors = [] if got is buf and np.array_equal(buf, expected) else ["wrong"]
                    failures += _fail(errors, dtype=np.dtype(dtype).name, count=count,
                                      root=root, rep=rep)
    assert not failures, "\n".join(failures[:10])


@pytest.mark.parametrize("algorithm", mpicoll.algorithms("reduce") + ["auto"])
def test_reduce(algorithm):
    failures = []
    for op in RED_OPS + ["prod", "min"]:
        for dtype in [d for d in ALL_DTYPES if applicable(op, d)][::2]:
            for count in COUNTS:
                for root in sorted({0, SIZE - 1}):
                    for in_place in IN_PLACE_FORMS:
                        out = np.empty(count, dtype=dtype)
                        for rep in range(2):
                            data = make_data(RANK, count, rep, dtype, op)
                            expected = reference_reduce(all_inputs(count, rep, dtype, op), op)
                            if in_place and RANK == root:
                                out[...] = data
                                got = mpicoll.reduce(None, out, op=op, root=root,
                                                     algorithm=algorithm)
                            else:
                                got = mpicoll.reduce(data, out if RANK == root else None, op=op,
                                                     root=root, algorithm=algorithm)
                            if RANK == root:
                                ok = got is out and bits_equal(out, expected)
                            else:
                                ok = got is None
                            failures += _fail([] if ok else ["wrong"], op=op,
                                              dtype=np.dtype(dtype).name, count=count,
                                              root=root, in_place=in_place, rep=rep)
    assert not failures, "\n".join(failures[:10])


def test_a_subcommunicator_keeps_its_ranks_emulated_nodes():
    """Emulated nodes are cut from the world's ranks, so a subcommunicator's ranks keep
    their nodes, as on a cluster (they were cut again from the subcommunicator's own
    ranks: one rank of each node made nodes of several); node-aware algorithms on it
    agree with MPI."""
    import os

    from mpi4py import MPI

    from mpicoll.context import get_context

    per_node = int(os.environ.get("MPICOLL_RANKS_PER_NODE", "0"))
    if per_node < 2 or SIZE <= per_node:
        pytest.skip("needs MPICOLL_RANKS_PER_NODE >= 2 and several emulated nodes")
    sub = COMM.Split(RANK % per_node, RANK)  # one rank of each node, per local rank
    members = [r for r in range(SIZE) if r % per_node == RANK % per_node]
    nodes = sorted({r // per_node for r in members})
    topo = get_context(sub).topology
    assert topo.num_nodes == len(nodes) and topo.node_index == nodes.index(RANK // per_node)
    x = np.arange(1001, dtype=np.int64) * (RANK + 1)
    want = np.empty_like(x)
    sub.Allreduce(x, want, op=MPI.SUM)
    for algorithm in ("hierarchical", "shm", "auto"):
        assert np.array_equal(mpicoll.allreduce(x, comm=sub, algorithm=algorithm), want)
    sub.Free()


def test_auto_is_told_the_node_layout(monkeypatch):
    """``auto`` looks the table up with the ranks per node (uneven nodes: the largest node's,
    so that the layout is known to span nodes; it was 0, read as one node)."""
    import os  # noqa: PLC0415

    from mpicoll import collectives, fastpath  # noqa: PLC0415
    from mpicoll.context import get_context  # noqa: PLC0415

    per_node = min(int(os.environ.get("MPICOLL_RANKS_PER_NODE", "0")) or SIZE, SIZE)
    assert get_context(COMM).ranks_per_node == per_node
    seen = []
    real = collectives.resolve_algorithm
    monkeypatch.setattr(collectives, "resolve_algorithm",
                        lambda *args: seen.append(args) or real(*args))
    fastpath.invalidate()
    for collective, call in [("allreduce", lambda x, y: mpicoll.allreduce(x, y)),
                             ("reduce", lambda x, y: mpicoll.reduce(x, y))]:
        call(np.ones(3), np.empty(3))
        assert seen[-1][0] == collective and seen[-1][3] == per_node, seen[-1]
    fastpath.invalidate()


@pytest.mark.parametrize("algorithm", mpicoll.algorithms("reduce_scatter"))
def test_reduce_scatter_with_an_empty_block_viewing_the_send_buffer(algorithm):
    """Ranks whose block is empty may pass an empty view into sendbuf's memory (MPICH
    rejects that as aliased buffers if handed on as such)."""
    n = COMM.Get_size()
    count = max(n - 1, 1)
    slot = np.zeros(2 * count + 2, dtype=np.int64)
    send = slot[:count]
    send[:] = np.arange(count) + RANK
    mine = 1 if RANK < count else 0
    recv = slot[count + 1:count + 1 + mine]
    mpicoll.reduce_scatter(send, recv, algorithm=algorithm)
    if mine:
        assert recv[0] == n * RANK + n * (n - 1) // 2
