"""All-reduce: every registered algorithm x op x dtype x count x in place, twice per case."""
from __future__ import annotations

import numpy as np
import pytest

import mpicoll

from cases import (ALL_DTYPES, COMM, COUNTS, IN_PLACE_FORMS, RANK, SIZE, all_inputs,
                   applicable, bits_equal, describe, gather_inputs, make_data, reference_reduce,
                   same_on_all_ranks)

pytestmark = pytest.mark.mpi

ALGORITHMS = mpicoll.algorithms("allreduce") + ["auto"]
OPS = sorted(mpicoll.OPS)


def check_allreduce(algorithm: str, op: str, dtype: type, count: int, in_place: bool,
                    fn=mpicoll.allreduce) -> list[str]:
    """Run one case twice on the same buffers; return failure descriptions (empty: ok)."""
    errors = []
    out = np.empty(count, dtype=dtype)
    for rep in range(2):
        data = make_data(RANK, count, rep, dtype, op)
        expected = reference_reduce(all_inputs(count, rep, dtype, op), op)
        if in_place:
            out[...] = data
            got = fn(mpicoll.IN_PLACE, out, op=op, algorithm=algorithm)
        else:
            got = fn(data, out, op=op, algorithm=algorithm)
            if not np.array_equal(data, make_data(RANK, count, rep, dtype, op)):
                errors.append("sendbuf was modified")
        if got is not out:
            errors.append("did not return recvbuf")
        if not bits_equal(out, expected):  # every rank: so the replicas agree bit for bit
            bad = np.flatnonzero(out != expected)[:5]
            errors.append(f"wrong result at {bad.tolist()}: {out[bad]} != {expected[bad]}")
        if errors:
            return [describe(algorithm=algorithm, op=op, dtype=np.dtype(dtype).name,
                             count=count, in_place=in_place, rep=rep) + ": " + "; ".join(errors)]
    return []


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("op", OPS)
def test_allreduce_matches_reference(algorithm, op, segment):
    failures = []
    dtypes = [d for d in ALL_DTYPES if applicable(op, d)]
    for dtype in dtypes:
        for count in COUNTS:
            for in_place in IN_PLACE_FORMS:
                failures += check_allreduce(algorithm, op, dtype, count, in_place)
    assert not failures, "\n".join(failures[:10])


@pytest.mark.parametrize("algorithm", mpicoll.algorithms("allreduce"))
def test_allreduce_matches_native_on_random_floats(algorithm):
    """Random floats: within tolerance of native MPI, and bit-identical across ranks."""
    rng = np.random.default_rng(1234 + RANK)
    for dtype, rtol in ((np.float32, 1e-5), (np.float64, 1e-12), (np.float16, 5e-2)):
        x = rng.standard_normal(1001).astype(dtype)
        ours = mpicoll.allreduce(x, algorithm=algorithm)
        native = mpicoll.allreduce(x, algorithm="native")
        assert same_on_all_ranks(ours), f"{algorithm} {dtype}: replicas differ"
        np.testing.assert_allclose(ours.astype(np.float64), native.astype(np.float64),
                                   rtol=rtol, atol=rtol * 10)


@pytest.mark.parametrize("algorithm", mpicoll.algorithms("allreduce"))
def test_one_random_complex_product_is_the_same_on_every_rank(algorithm):
    """A product of one random complex element: bit-identical across ranks (numpy's
    one-element multiply into one of its operands gave other bits than into a third
    array, and the folded schedules do both on different ranks: 45 of 100 calls
    differed at n = 3)."""
    rng = np.random.default_rng(99 + RANK)
    for dtype in (np.complex64, np.complex128):
        for _ in range(20):
            x = (rng.standard_normal(1) + 1j * rng.standard_normal(1)).astype(dtype)
            ours = mpicoll.allreduce(x, op="prod", algorithm=algorithm)
            assert same_on_all_ranks(ours), f"{algorithm} {np.dtype(dtype).name}: replicas differ"
            np.testing.assert_allclose(ours, np.prod(gather_inputs(x)), rtol=1e-5)


def test_a_collective_that_does_not_communicate_is_caught():
    """The checks above must fail for an 'all-reduce' that only copies its input."""
    def fake(sendbuf, recvbuf, op="sum", algorithm="auto"):
        recvbuf[...] = recvbuf if sendbuf is mpicoll.IN_PLACE else sendbuf
        return recvbuf

    failures = check_allreduce("fake", "sum", np.int32, 13, False, fn=fake)
    if COMM.Get_size() > 1:
        assert failures, "a non-communicating all-reduce passed the check"
    else:
        assert not failures


def test_shapes_and_allocation():
    x = np.arange(24, dtype=np.float64).reshape(2, 3, 4) + RANK
    y = mpicoll.allreduce(x)
    n = COMM.Get_size()
    assert y.shape == x.shape
    np.testing.assert_array_equal(y, np.arange(24).reshape(2, 3, 4) * n + n * (n - 1) / 2)
    f = np.asfortranarray(x)
    z = mpicoll.allreduce(f, op="max")
    np.testing.assert_array_equal(z, x - RANK + n - 1)


@pytest.mark.parametrize("algorithm", ["shm", "hierarchical"])
def test_node_aware_algorithms_on_the_real_node_layout(algorithm, monkeypatch):
    """shm and hierarchical on one real shared-memory node (the suite's other runs emulate
    several nodes): a fresh communicator, made without MPICOLL_RANKS_PER_NODE."""
    from mpicoll import config  # noqa: PLC0415

    monkeypatch.delenv("MPICOLL_RANKS_PER_NODE", raising=False)
    monkeypatch.setenv("MPICOLL_SHM_CHUNK_BYTES", "1024")  # several chunks
    config.refresh()
    comm = COMM.Dup()
    try:
        for count in (0, 1, 13, 1000, 4099):
            for rep in range(2):
                data = make_data(RANK, count, rep, np.int64)
                expected = reference_reduce(all_inputs(count, rep, np.int64), "sum")
                got = mpicoll.allreduce(data, op="sum", comm=comm, algorithm=algorithm)
                assert np.array_equal(got, expected), (algorithm, count, rep)
                assert same_on_all_ranks(got)
    finally:
        comm.Free()
        monkeypatch.undo()
        config.refresh()


@pytest.mark.parametrize("fresh", [False, True], ids=["same x", "new x"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_repeated_allocating_calls_follow_the_input(algorithm, fresh):
    """``y = allreduce(x)`` on the same ``x`` (a cached call that allocates each time), and
    on a new ``x`` of the same shape each time (a call by shape)."""
    x = np.empty((3, 7), dtype=np.int64)
    seen = []
    for rep in range(3):
        if fresh:
            x = np.empty((3, 7), dtype=np.int64)
        x[...] = make_data(RANK, x.size, rep, np.int64).reshape(x.shape)
        expected = reference_reduce(gather_inputs(x.reshape(-1).copy()), "average")
        got = mpicoll.allreduce(x, op="average", algorithm=algorithm)
        assert got.shape == x.shape and all(got is not s for s in seen)
        assert np.array_equal(got.reshape(-1), expected), (algorithm, rep)
        seen.append(got)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_persistent_allreduce_follows_the_input(algorithm):
    """``call = allreduce_init(x, y)``; ``call()`` reduces x's current contents each time."""
    x = np.empty(1001, dtype=np.int64)
    y = np.empty_like(x)
    call = mpicoll.allreduce_init(x, y, op="average", algorithm=algorithm)
    for rep in range(3):
        x[:] = make_data(RANK, x.size, rep, np.int64)
        assert call() is y
        assert np.array_equal(y, reference_reduce(gather_inputs(x.copy()), "average"))
    inplace = mpicoll.allreduce_init(mpicoll.IN_PLACE, y, op="max", algorithm=algorithm)
    y[:] = make_data(RANK, y.size, 0, np.int64, "max")
    expected = reference_reduce(gather_inputs(y.copy()), "max")
    assert np.array_equal(inplace(), expected)


def test_persistent_allreduce_rejects_bad_arguments_at_planning():
    with pytest.raises(ValueError, match="recvbuf"):
        mpicoll.allreduce_init(np.ones(3), np.ones(4))
    call = mpicoll.allreduce_init(np.ones(3))   # allocates one output, reused
    assert call() is call()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_scaled_sum_scales_once_after_the_sum(algorithm):
    """``op=scaled_sum(f)`` (the torch adapter's Average/postscale, applied per shard by the
    algorithms that scale shards): the exact sum times ``f`` in the buffer's dtype."""
    from mpicoll.ops import scaled_sum  # noqa: PLC0415

    factor = 1 / (3 * SIZE)
    for dtype in (np.float32, np.float64):
        for count in (1, 2 * SIZE + 3, 1001):
            x = make_data(RANK, count, 1, np.int32).astype(dtype)  # integers: exact sums
            expected = reference_reduce(gather_inputs(x), "sum")
            if SIZE > 1:
                expected = expected * dtype(factor)
            got = mpicoll.allreduce(x, op=scaled_sum(factor), algorithm=algorithm)
            assert np.array_equal(got, expected), (algorithm, dtype, count)
