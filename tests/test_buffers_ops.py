"""Serial tests of buffer parsing/validation, ops and algorithm selection."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
from mpicoll.buffers import Unsupported, flat_view, parse_mpi_buffer
from mpicoll.ops import resolve_op
from mpicoll.selection import choose, resolve_algorithm


def test_flat_view_is_a_view():
    a = np.arange(12.0).reshape(3, 4)
    v = flat_view(a, "x", writable=True)
    v[0] = 99
    assert a[0, 0] == 99 and v.size == 12
    f = np.asfortranarray(a)
    assert np.shares_memory(flat_view(f, "x"), f)


@pytest.mark.parametrize("bad,exc,words", [
    ([1, 2], TypeError, "x must be a numpy"),
    (np.arange(10)[::2], ValueError, "x must be contiguous"),
    (np.array(["s"]), TypeError, "x has dtype"),
    (np.zeros(2, dtype=[("a", "i4")]), TypeError, "x has dtype"),
])
def test_flat_view_rejects(bad, exc, words):
    with pytest.raises(exc, match=words):
        flat_view(bad, "x")


def test_flat_view_read_only():
    a = np.zeros(3)
    a.flags.writeable = False
    flat_view(a, "x")
    with pytest.raises(ValueError, match="x is read-only"):
        flat_view(a, "x", writable=True)


def test_parse_mpi_buffer_forms():
    a = np.arange(10, dtype="d")
    assert parse_mpi_buffer(a, "b").size == 10
    assert parse_mpi_buffer([a, MPI.DOUBLE], "b").size == 10
    v = parse_mpi_buffer([a, 4, MPI.DOUBLE], "b")
    assert v.tolist() == [0, 1, 2, 3]
    assert parse_mpi_buffer([a, (3, 2), MPI.DOUBLE], "b").tolist() == [2, 3, 4]
    assert parse_mpi_buffer([a, 3, 2, MPI.DOUBLE], "b").tolist() == [2, 3, 4]
    assert parse_mpi_buffer([a, "d"], "b").dtype == np.float64
    assert parse_mpi_buffer([None, MPI.INT], "b").size == 0
    ints = parse_mpi_buffer([a, MPI.INT], "b")
    assert ints.dtype == np.intc and ints.size == 20
    raw = bytearray(8)
    w = parse_mpi_buffer([raw, MPI.INT], "b", writable=True)
    w[1] = 7
    assert np.frombuffer(bytes(raw), "i")[1] == 7


def test_parse_mpi_buffer_unsupported_and_bad():
    a = np.arange(10, dtype="d")
    vec = MPI.DOUBLE.Create_vector(2, 1, 2)
    try:
        with pytest.raises(Unsupported):
            parse_mpi_buffer([a, 1, vec], "b")
    finally:
        vec.Free()
    with pytest.raises(Unsupported):
        parse_mpi_buffer([a, MPI.DOUBLE_INT], "b")
    with pytest.raises(Unsupported):
        parse_mpi_buffer([a, [1, 2], [0, 1], MPI.DOUBLE], "b")
    with pytest.raises(ValueError, match="does not fit"):
        parse_mpi_buffer([a, 11, MPI.DOUBLE], "b")
    with pytest.raises(ValueError, match="read-only"):
        parse_mpi_buffer([bytes(8), MPI.INT], "b", writable=True)


def test_ops_resolve_and_apply():
    assert resolve_op("SUM") is mpicoll.OPS["sum"]
    assert resolve_op(MPI.MAX) is mpicoll.OPS["max"]
    assert resolve_op("mean").name == "average"
    with pytest.raises(ValueError, match="unknown op"):
        resolve_op("median")
    with pytest.raises(ValueError, match="not one mpicoll implements"):
        resolve_op(MPI.MAXLOC)
    with pytest.raises(TypeError):
        resolve_op(1)
    a, b = np.array([1, 5, 3], np.int16), np.array([4, 2, 3], np.int16)
    out = np.empty_like(a)
    for name, ref in [("sum", a + b), ("prod", a * b), ("min", np.minimum(a, b)),
                      ("max", np.maximum(a, b)), ("band", a & b), ("bor", a | b),
                      ("bxor", a ^ b)]:
        mpicoll.OPS[name].combine(a, b, out)
        assert out.tolist() == ref.tolist(), name
    avg = np.array([3.0, 5.0], np.float16)
    mpicoll.OPS["average"].finalize(avg, 2)
    assert avg.tolist() == [1.5, 2.5]
    iavg = np.array([-3, 5])
    mpicoll.OPS["average"].finalize(iavg, 2)
    assert iavg.tolist() == [-2, 2]  # floor division for integers
    with pytest.raises(TypeError, match="does not apply"):
        mpicoll.OPS["band"].check_dtype(np.dtype("f4"))
    with pytest.raises(TypeError, match="does not apply"):
        mpicoll.OPS["max"].check_dtype(np.dtype("c8"))


def test_selection_is_registered_and_deterministic(monkeypatch):
    for coll in mpicoll.COLLECTIVES:
        for n in (2, 3, 4, 8):
            for nbytes in (8, 4096, 65536, 1 << 20, 64 << 20):
                name = choose(coll, n, 1, nbytes)
                assert name in mpicoll.algorithms(coll)
                assert name == choose(coll, n, 1, nbytes)
    with pytest.raises(ValueError, match="unknown algorithm"):
        resolve_algorithm("allreduce", "nope", 2, 1, 8)
    with pytest.raises(TypeError):
        resolve_algorithm("allreduce", None, 2, 1, 8)
    from mpicoll import config

    monkeypatch.setenv("MPICOLL_ALGORITHM", "tree")
    config.refresh()
    try:
        assert choose("allreduce", 4, 1, 8) == "tree"
        assert choose("broadcast", 4, 1, 8) in mpicoll.algorithms("broadcast")
    finally:
        monkeypatch.delenv("MPICOLL_ALGORITHM")
        config.refresh()


def test_algorithms_listing():
    assert set(mpicoll.algorithms("allreduce")) >= {"ring", "recursive_doubling", "rabenseifner",
                                                   "tree", "hierarchical", "native"}
    with pytest.raises(ValueError):
        mpicoll.algorithms("alltoall")
