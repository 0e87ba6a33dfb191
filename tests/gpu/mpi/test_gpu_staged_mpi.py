"""The staged path under mpirun, on the CPU: fake device arrays through the real
collectives (every collective and algorithm), and the errors across ranks.

The device side is :class:`doubles.device_copies.SimulatedCopies` (numpy arrays behind
objects exposing ``__cuda_array_interface__``), the host collectives are mpicoll's own,
so what runs here is the whole staged path except CuPy's copies.
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
from gpu_helpers import FakeDevice, fake_copies, rank_data, reference
from mpicoll import IN_PLACE
from mpicoll.gpu import route
from mpicoll.partition import block_bounds

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
NOT_AWARE = (False, "test: staged")
PUBLIC = {"allreduce": mpicoll.allreduce, "reduce_scatter": mpicoll.reduce_scatter,
          "allgather": mpicoll.allgather, "broadcast": mpicoll.broadcast,
          "reduce": mpicoll.reduce}
CASES = [(c, a) for c in PUBLIC for a in mpicoll.algorithms(c)]


def staged(collective, args, check=None, chunk_bytes=48, copies=None):
    done, out = route.device_call(collective, args, None, check, PUBLIC[collective],
                                  aware=NOT_AWARE, copies=copies or fake_copies(),
                                  chunk_bytes=chunk_bytes)
    assert done
    return out


def _one(collective: str, algorithm: str, count: int, dtype, rep: int) -> None:
    inputs = [rank_data(r, count, dtype, rep) for r in range(SIZE)]
    x = FakeDevice(inputs[RANK].copy())
    root = SIZE - 1
    if collective == "allreduce":
        out = staged(collective, (x, None, "sum", algorithm)).array
    elif collective == "reduce":
        out = staged(collective, (x, None, "sum", root, algorithm))
        out = None if out is None else out.array
    elif collective == "broadcast":
        buf = x if RANK == root else FakeDevice(np.zeros(count, dtype))
        assert staged(collective, (buf, root, algorithm)) is buf
        out = buf.array
    elif collective == "reduce_scatter":
        b = block_bounds(count, SIZE)
        y = FakeDevice(np.zeros(b[RANK + 1] - b[RANK], dtype))
        assert staged(collective, (x, y, "sum", algorithm)) is y
        out = y.array
    else:
        y = FakeDevice(np.zeros(count * SIZE, dtype))
        assert staged(collective, (x, y, algorithm)) is y
        out = y.array
    want = reference(collective, inputs, RANK, root)
    if want is None:
        assert out is None
    else:
        np.testing.assert_array_equal(out, want)
        assert out.tobytes() == want.astype(dtype).tobytes()  # bit for bit


@pytest.mark.parametrize("collective,algorithm", CASES)
def test_every_collective_and_algorithm(collective: str, algorithm: str) -> None:
    for count in (0, 1, SIZE + 1, 97):
        for rep in range(2):
            _one(collective, algorithm, count, np.float32, rep)
    _one(collective, algorithm, 50, np.int64, 0)


def test_in_place_forms() -> None:
    x = rank_data(RANK, 40, np.int32)
    inputs = [rank_data(r, 40, np.int32) for r in range(SIZE)]
    buf = FakeDevice(x.copy())
    staged("allreduce", (IN_PLACE, buf, "sum", "auto"))
    np.testing.assert_array_equal(buf.array, reference("allreduce", inputs, RANK))
    full = FakeDevice(x.copy())
    out = staged("reduce_scatter", (IN_PLACE, full, "sum", "auto"))
    np.testing.assert_array_equal(out, reference("reduce_scatter", inputs, RANK))
    y = FakeDevice(np.zeros(40 * SIZE, np.int32))
    y.array[RANK * 40:(RANK + 1) * 40] = x
    staged("allgather", (IN_PLACE, y, "auto"))
    np.testing.assert_array_equal(y.array, reference("allgather", inputs, RANK))


def test_average_and_max() -> None:
    x = FakeDevice(np.full(33, float(RANK + 1)))
    out = staged("allreduce", (x, None, "average", "auto")).array
    np.testing.assert_array_equal(out, np.full(33, (SIZE + 1) / 2))
    out = staged("allreduce", (x, None, "max", "auto")).array
    np.testing.assert_array_equal(out, np.full(33, float(SIZE)))


def test_checked_mode_bad_arguments_on_one_rank() -> None:
    x = FakeDevice(np.zeros(20))
    bad = FakeDevice(np.zeros(19 if RANK == 0 else 20))
    if RANK == 0:
        with pytest.raises(ValueError, match="recvbuf has 19 elements but 20 are needed"):
            staged("allreduce", (x, bad, "sum", "auto"), check=True)
    elif SIZE > 1:
        with pytest.raises(mpicoll.RemoteError, match="rank 0: ValueError: recvbuf has 19"):
            staged("allreduce", (x, bad, "sum", "auto"), check=True)


def test_checked_mode_mixed_buffers_on_one_rank() -> None:
    if RANK == 0:
        with pytest.raises(TypeError, match="sendbuf is a device array"):
            staged("allreduce", (FakeDevice(np.zeros(8)), np.zeros(8), "sum", "auto"),
                   check=True)
    elif SIZE > 1:
        with pytest.raises(mpicoll.RemoteError, match="rank 0: TypeError"):
            staged("allreduce", (FakeDevice(np.zeros(8)), FakeDevice(np.zeros(8)), "sum",
                                 "auto"), check=True)


@pytest.mark.skipif(SIZE < 2, reason="needs two ranks")
def test_checked_mode_device_rank_and_host_rank_disagree() -> None:
    """Rank 0 stages 100 elements in chunks; the others pass host arrays: every rank
    raises MismatchError (the chunk counts differ) instead of hanging."""
    if RANK == 0:
        with pytest.raises(mpicoll.MismatchError, match="count"):
            staged("allreduce", (FakeDevice(np.ones(100)), None, "sum", "auto"), check=True,
                   chunk_bytes=80)
    else:
        with pytest.raises(mpicoll.MismatchError, match="count"):
            mpicoll.allreduce(np.ones(100), None, "sum", check=True)
    mpicoll.allreduce(np.ones(4), check=True)  # and the next call works on every rank


def test_no_comm_means_the_runtime_world(monkeypatch) -> None:
    """``comm=None`` plans with the runtime's world (here every other rank: what an elastic
    shrink leaves), as its host calls run on it; not with ``MPI.COMM_WORLD``."""
    from mpicoll.runtime import world

    sub = COMM.Split(RANK % 2, RANK)
    try:
        monkeypatch.setattr(world, "comm", lambda: sub)
        inputs = [rank_data(r, 5, np.float64) for r in range(RANK % 2, SIZE, 2)]
        y = FakeDevice(np.zeros(5 * sub.Get_size()))
        assert staged("allgather", (FakeDevice(inputs[sub.Get_rank()].copy()), y, "auto")) is y
        np.testing.assert_array_equal(y.array, np.concatenate(inputs))
    finally:
        monkeypatch.undo()
        sub.Free()
