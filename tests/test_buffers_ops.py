"""Serial tests of buffer parsing/validation, ops and algorithm selection."""
from __future__ import annotations

from types import SimpleNamespace

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


# -- mpicoll.validation: the one set of buffer checks of the host, device and compressed
# paths; where the paths used to differ, each now behaves as the host collectives do


def _ranks(rank: int, size: int) -> SimpleNamespace:
    """``Get_rank``/``Get_size`` of one rank of a world that never runs a host call."""
    return SimpleNamespace(Get_rank=lambda: rank, Get_size=lambda: size)


def _staged_refuses(collective: str, args: tuple, exc: type, words: str) -> None:
    """The staged device path (rank 0 of 2, simulated devices) raises ``exc`` matching
    ``words``, reported to the other ranks (checked mode), before any copy."""
    from mpicoll.gpu import staging
    from doubles.device_copies import SimulatedCopies

    copies, reported = SimulatedCopies(), []
    with pytest.raises(exc, match=words):
        staging.staged(collective, args, lambda a: pytest.fail("host call made"),
                       comm=_ranks(0, 2), copies=copies, report_error=reported.append)
    assert [type(e) for e in reported] == [exc]
    assert not any(e[0] in ("d2h", "h2d") for e in copies.log)


@pytest.mark.parametrize("collective,make", [   # (w: 16 elements, n: ranks)
    ("allreduce", lambda w, n: (w[:8], w[4:12], "sum")),
    ("reduce", lambda w, n: (w[:8], w[4:12], "sum", 0)),
    ("reduce_scatter", lambda w, n: (w[:8], w[2:2 + 8 // n], "sum")),
    ("allgather", lambda w, n: (w[:4], w[2:2 + 4 * n])),
])
def test_staged_path_refuses_overlapping_buffers_as_the_host_does(collective, make):
    # (the staged path used to copy overlapping buffers chunk by chunk: a corrupt result)
    wide = np.arange(16, dtype=np.float32)
    with pytest.raises(ValueError, match="sendbuf and recvbuf overlap"):
        getattr(mpicoll, collective)(*make(wide.copy(), 1))
    _staged_refuses(collective, make(wide.copy(), 2), ValueError,
                    "sendbuf and recvbuf overlap")


def test_staged_path_checks_the_op_against_the_dtype_before_any_copy():
    # (the staged path used to find it in its first host call, after copying chunk 0)
    x = np.arange(8, dtype=np.float32)
    with pytest.raises(TypeError, match="op='band' does not apply to dtype float32"):
        mpicoll.allreduce(x, op="band")
    _staged_refuses("allreduce", (x, None, "band"), TypeError,
                    "op='band' does not apply to dtype float32")


def test_compressed_allreduce_on_the_same_memory_works_in_place_as_the_host_does():
    # (the compressed all-reduce used to refuse a recvbuf that is sendbuf's memory under
    # another array object: "recvbuf overlaps sendbuf")
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    same = x.reshape(8)
    assert mpicoll.allreduce(x, same) is same
    assert mpicoll.allreduce(x, same, compression="fp16") is same
    assert same.tolist() == list(range(8))


@pytest.mark.parametrize("collective", ["reduce_scatter", "allgather"])
def test_compressed_scatter_gather_refuse_recvbuf_is_sendbuf_as_the_host_does(collective):
    # (one rank: the compressed ones used to run with recvbuf the very sendbuf array)
    x = np.arange(8, dtype=np.float32)
    fn = getattr(mpicoll, collective)
    with pytest.raises(ValueError, match="sendbuf and recvbuf overlap"):
        fn(x, x)
    with pytest.raises(ValueError, match="sendbuf and recvbuf overlap"):
        fn(x, x, compression="fp16")


@pytest.mark.parametrize("compression", [None, "fp16"])
@pytest.mark.parametrize("call,exc,words", [
    (lambda c: mpicoll.allreduce(IN, None, compression=c), ValueError,
     "recvbuf is required when sendbuf is IN_PLACE/None"),
    (lambda c: mpicoll.allreduce(X, np.empty(9, np.float32), compression=c), ValueError,
     "recvbuf has 9 elements but 8 are needed (as many as sendbuf)"),
    (lambda c: mpicoll.allreduce(X, np.empty(8, np.float64), compression=c), TypeError,
     "recvbuf has dtype float64 but sendbuf has dtype float32"),
    (lambda c: mpicoll.allreduce(X, _read_only(), compression=c), ValueError,
     "recvbuf is read-only"),
    (lambda c: mpicoll.reduce_scatter(X, np.empty(3, np.float32), compression=c), ValueError,
     "recvbuf has 3 elements but 8 are needed (block 0 of 8 elements over 1 ranks)"),
    (lambda c: mpicoll.allgather(X, np.empty(3, np.float32), compression=c), ValueError,
     "recvbuf has 3 elements but 8 are needed (1 ranks x 8)"),
    (lambda c: mpicoll.allgather(IN, None, compression=c), ValueError,
     "recvbuf is required when sendbuf is IN_PLACE/None"),
])
def test_host_and_compressed_paths_raise_the_same_errors(call, exc, words, compression):
    with pytest.raises(exc) as info:
        call(compression)
    assert words in str(info.value)


IN = mpicoll.IN_PLACE
X = np.arange(8, dtype=np.float32)


def _read_only() -> np.ndarray:
    out = np.empty(8, np.float32)
    out.flags.writeable = False
    return out


def test_validation_checks_root_and_in_place_rules():
    from mpicoll import validation

    with pytest.raises(TypeError, match="root must be an int, not bool"):
        validation.check_root(True, 2)
    with pytest.raises(ValueError, match="root=2 is out of range for a communicator of 2"):
        validation.check_root(2, 2)
    with pytest.raises(ValueError, match="only the root may reduce in place"):
        validation.reduce(IN, X, 0, 1, 2, flat_view)
    send, recv, in_place = validation.reduce_scatter(IN, np.zeros(9, np.float32), 2, 4,
                                                     flat_view)
    assert in_place and send.size == 9 and recv.size == 2 and np.shares_memory(send, recv)
    send, recv, in_place = validation.allgather(IN, np.arange(9.0), 1, 3, flat_view)
    assert in_place and send.tolist() == [3.0, 4.0, 5.0] and recv.size == 9
    assert validation.gathered_shape((), 3) == (3,)
    assert validation.gathered_shape((2, 5), 3) == (6, 5)


@pytest.mark.parametrize("spec, words", [
    ([np.zeros(4), "no-such-code"], "unknown type code 'no-such-code'"),
    ([np.zeros(4), 3.5], "float is not an MPI datatype"),
    ([np.zeros(4), MPI.DOUBLE.Create_vector(2, 1, 2)], "derived datatypes with gaps"),
    ([np.zeros(4), 1, 0, 0, MPI.DOUBLE], "buffer spec of 5 items"),
    ([object(), MPI.DOUBLE], "object does not expose a contiguous buffer"),
    ({"not": "a buffer"}, "dict is not a buffer mpicoll knows"),
])
def test_parse_mpi_buffer_leaves_what_it_cannot_handle_to_mpi(spec, words):
    """Specs mpicoll does not handle raise Unsupported (Comm then calls MPI), saying why."""
    with pytest.raises(Unsupported, match=words):
        parse_mpi_buffer(spec, "b")


@pytest.mark.parametrize("spec, words", [
    ([np.zeros((4, 4))[:, 1], MPI.DOUBLE], "b must be contiguous"),
    (np.zeros((4, 4))[:, 1], "b must be contiguous"),
    ([None, 3, MPI.DOUBLE], "buffer is None but count is 3"),
])
def test_parse_mpi_buffer_refuses_inconsistent_specs(spec, words):
    """A spec that cannot be right is a ValueError naming the argument."""
    with pytest.raises(ValueError, match=words):
        parse_mpi_buffer(spec, "b")


def test_parse_mpi_buffer_views_bytes_like_objects():
    """bytes, bytearray and memoryview are viewed as bytes (no copy for a writable one)."""
    raw = bytearray(b"\x01\x02\x03")
    view = parse_mpi_buffer(raw, "b", writable=True)
    view[0] = 9
    assert raw[0] == 9 and view.dtype == np.uint8
    assert parse_mpi_buffer(memoryview(b"ab"), "b").tolist() == [97, 98]
    assert parse_mpi_buffer([None, 0, MPI.INT], "b").size == 0
