"""Bad input: clear errors naming the argument, on every rank, and never a hang."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
from mpicoll.context import get_context

from cases import COMM, RANK, SIZE

pytestmark = pytest.mark.mpi

X = np.arange(8, dtype=np.float32)


def read_only(n: int) -> np.ndarray:
    a = np.zeros(n, dtype=np.float32)
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("call,exc,words", [
    (lambda c: mpicoll.allreduce(X, np.empty(16, np.float32)[::2], check=c), ValueError,
     "recvbuf must be contiguous"),
    (lambda c: mpicoll.allreduce(X, np.empty(7, np.float32), check=c), ValueError,
     "recvbuf has 7 elements"),
    (lambda c: mpicoll.allreduce(X, np.empty(8, np.float64), check=c), TypeError,
     "recvbuf has dtype float64"),
    (lambda c: mpicoll.allreduce(X, read_only(8), check=c), ValueError,
     "recvbuf is read-only"),
    (lambda c: mpicoll.allreduce(X, op="median", check=c), ValueError, "unknown op='median'"),
    (lambda c: mpicoll.allreduce(X, op=3, check=c), TypeError, "op must be"),
    (lambda c: mpicoll.allreduce(X, op="band", check=c), TypeError,
     "op='band' does not apply to dtype float32"),
    (lambda c: mpicoll.allreduce(X, algorithm="fastest", check=c), ValueError,
     "unknown algorithm='fastest'"),
    (lambda c: mpicoll.allreduce([1, 2], check=c), TypeError, "sendbuf must be a numpy"),
    (lambda c: mpicoll.allreduce(np.array(["a"]), check=c), TypeError, "sendbuf has dtype"),
    (lambda c: mpicoll.allreduce(X, X[2:], check=c), ValueError, "recvbuf has 6 elements"),
    (lambda c: mpicoll.allreduce(X, np.zeros(8, bool), op="sum", check=c), TypeError,
     "recvbuf has dtype bool"),
    (lambda c: mpicoll.allreduce(np.zeros(3, bool), check=c), TypeError,
     "op='sum' does not apply to dtype bool"),
    (lambda c: mpicoll.allreduce(mpicoll.IN_PLACE, check=c), ValueError, "recvbuf is required"),
    (lambda c: mpicoll.broadcast(X, root=SIZE, check=c), ValueError, f"root={SIZE} is out of range"),
    (lambda c: mpicoll.broadcast(X, root=-1, check=c), ValueError, "out of range"),
    (lambda c: mpicoll.reduce(X, root="0", check=c), TypeError, "root must be an int"),
    (lambda c: mpicoll.reduce_scatter(X, np.empty(X.size + 1, np.float32), check=c), ValueError,
     "recvbuf has"),
    (lambda c: mpicoll.allgather(X, np.empty(X.size * SIZE + 1, np.float32), check=c), ValueError,
     "recvbuf has"),
    (lambda c: mpicoll.allreduce(X, comm="world", check=c), TypeError, "comm must be"),
    # paired by memory position, not by index: silently transposed results before
    (lambda c: mpicoll.allreduce(X.reshape(2, 4), np.zeros((2, 4), np.float32, order="F"),
                                 check=c), ValueError, "different memory orders"),
    (lambda c: mpicoll.allgather(np.asfortranarray(X.reshape(2, 4)),
                                 np.empty((2 * SIZE, 4), np.float32), check=c), ValueError,
     "different memory orders"),
])
def test_bad_argument_same_on_every_rank(call, exc, words, check):
    with pytest.raises(exc, match=None) as info:
        call(check)
    assert words in str(info.value), str(info.value)
    # the communicator still works afterwards (no half-sent messages left behind)
    np.testing.assert_array_equal(mpicoll.allreduce(X), X * SIZE)


def test_overlapping_buffers_rejected():
    buf = np.arange(10, dtype=np.int32)
    with pytest.raises(ValueError, match="overlap"):
        mpicoll.allreduce(buf[:8], buf[2:])


def test_checked_mode_one_bad_rank_raises_everywhere():
    bad = SIZE - 1
    recv = np.empty(7 if RANK == bad else 8, dtype=np.float32)
    if SIZE == 1:
        with pytest.raises(ValueError):
            mpicoll.allreduce(X, recv, check=True)
        return
    if RANK == bad:
        with pytest.raises(ValueError, match="recvbuf has 7 elements"):
            mpicoll.allreduce(X, recv, check=True)
    else:
        with pytest.raises(mpicoll.RemoteError, match=f"rank {bad}: ValueError") as info:
            mpicoll.allreduce(X, recv, check=True)
        assert bad in info.value.errors
    np.testing.assert_array_equal(mpicoll.allreduce(X), X * SIZE)


@pytest.mark.parametrize("what", ["count", "dtype", "op", "root", "algorithm",
                                  "segment_bytes"])
def test_checked_mode_mismatch_raises_everywhere(what):
    odd = RANK == SIZE - 1 and SIZE > 1
    kwargs = dict(algorithm="ring")
    x = X
    ctx = get_context(COMM)
    saved = ctx.segment_bytes
    if what == "segment_bytes" and odd:
        ctx.segment_bytes = saved + 64   # differs from any MPICOLL_SEGMENT_BYTES
    if what == "count" and odd:
        x = np.arange(9, dtype=np.float32)
    if what == "dtype" and odd:
        x = X.astype(np.float64)
    if what == "op" and odd:
        kwargs["op"] = "max"
    if what == "algorithm" and odd:
        kwargs["algorithm"] = "tree"
    if what == "root":
        buf = x.copy()
        call = lambda: mpicoll.broadcast(buf, root=(1 if odd else 0), check=True)  # noqa: E731
    else:
        call = lambda: mpicoll.allreduce(x, check=True, **kwargs)  # noqa: E731
    if SIZE == 1:
        call()
        return
    try:
        with pytest.raises(mpicoll.MismatchError) as info:
            call()
    finally:
        ctx.segment_bytes = saved
    message = str(info.value)
    assert f"{what}:" in message and f"ranks {SIZE - 1} have" in message, message
    np.testing.assert_array_equal(mpicoll.allreduce(X, check=True), X * SIZE)


def test_checked_mode_passes_when_all_agree():
    y = mpicoll.allreduce(X, op="average", check=True)
    np.testing.assert_allclose(y, X)
    out = mpicoll.reduce_scatter(np.ones(SIZE * 3, np.int64), check=True)
    np.testing.assert_array_equal(out, SIZE)


@pytest.mark.parametrize("case", ["read-only recvbuf", "count past the buffer",
                                  "reduce-scatter counts", "reduce-scatter-block sizes",
                                  "strided recvbuf", "structured dtype"])
def test_checked_comm_one_bad_rank_raises_everywhere(case):
    """mpicoll.Comm(check=True): a bad argument on one rank raises there and RemoteError on
    the others (the bad rank went to mpi4py alone, the others waited for it)."""
    comm = mpicoll.Comm(COMM, check=True)
    bad = RANK == SIZE - 1
    x, y = np.ones(8), np.zeros(8)
    if case == "read-only recvbuf":
        y.flags.writeable = not bad
        call = lambda: comm.Allreduce(x, y)  # noqa: E731
    elif case == "count past the buffer":
        call = lambda: comm.Allreduce([x, 9 if bad else 8, MPI.DOUBLE], y)  # noqa: E731
    elif case == "reduce-scatter counts":
        counts = [8 // SIZE + (r < 8 % SIZE) for r in range(SIZE)]
        out = np.zeros(counts[RANK] + bad)
        call = lambda: comm.Reduce_scatter(x, out, counts)  # noqa: E731
    elif case == "reduce-scatter-block sizes":
        send = np.ones(4 * SIZE - bad)
        call = lambda: comm.Reduce_scatter_block(send, np.zeros(4))  # noqa: E731
    elif case == "strided recvbuf":     # (the bad rank went to MPI alone: a hang)
        out = np.zeros(16)[::2] if bad else y
        call = lambda: comm.Allreduce(x, out)  # noqa: E731
    else:                               # (its TypeError escaped the agreement: a hang)
        send, out = (np.zeros(8, "i4,f4"), np.zeros(8, "i4,f4")) if bad else (x, y)
        call = lambda: comm.Allreduce(send, out)  # noqa: E731
    error = TypeError if case == "structured dtype" else ValueError
    if bad:
        with pytest.raises(error):
            call()
    else:
        with pytest.raises(mpicoll.RemoteError,
                           match=f"rank {SIZE - 1}: {error.__name__}"):
            call()
    comm.Allreduce(x, y if not bad else np.zeros(8))   # the communicator goes on
