"""mpicoll.Comm with device arrays in mpi4py buffer specs (one rank, simulated device):
bare arrays and ``[buf, datatype]``-style specs go through the same device route as
mpicoll's collectives; specs MPI alone could take are refused instead of handed to an
MPI library that may not be CUDA-aware."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
from gpu_helpers import FakeDevice, SimulatedBackend
from mpicoll.gpu import backends


@pytest.fixture
def comm():
    with backends.registered(SimulatedBackend()) as backend:
        yield mpicoll.Comm(MPI.COMM_WORLD), backend.simulated_copies


def test_collectives_take_device_specs(comm) -> None:
    c, copies = comm
    x = np.arange(12, dtype=np.float32)
    for _ in range(2):
        y = FakeDevice(np.zeros(12, np.float32))
        c.Allreduce([FakeDevice(x.copy()), MPI.FLOAT], [y, MPI.FLOAT], op=MPI.SUM)
        np.testing.assert_array_equal(y.array, x)
        z = FakeDevice(np.zeros(12, np.float32))
        c.Allgather(FakeDevice(x.copy()), z)
        np.testing.assert_array_equal(z.array, x)
        b = FakeDevice(x.copy())
        c.Bcast([b, MPI.FLOAT], root=0)
        np.testing.assert_array_equal(b.array, x)
        r = FakeDevice(np.zeros(12, np.float32))
        c.Reduce_scatter_block([FakeDevice(x.copy()), MPI.FLOAT], r)
        np.testing.assert_array_equal(r.array, x)
        c.Reduce_scatter(FakeDevice(x.copy()), r, [12])
        np.testing.assert_array_equal(r.array, x)
        d = FakeDevice(x.copy())
        c.Allreduce(MPI.IN_PLACE, d)
        c.Reduce(MPI.IN_PLACE, d, root=0)
        np.testing.assert_array_equal(d.array, x)
    assert copies.copied_bytes["d2h"] and copies.copied_bytes["h2d"]


def test_count_displacement_and_reinterpreting_specs(comm) -> None:
    c, _ = comm
    raw = np.arange(10, dtype=np.int32)
    out = FakeDevice(np.zeros(10, np.int32))
    c.Allreduce([FakeDevice(raw.copy()), 4, 3, MPI.INT], [out, (4, 2), MPI.INT])
    np.testing.assert_array_equal(out.array, [0, 0, 3, 4, 5, 6, 0, 0, 0, 0])
    as_bytes = FakeDevice(np.zeros(40, np.uint8))
    c.Bcast([as_bytes, MPI.INT], root=0)                 # bytes seen as 10 ints
    assert as_bytes.array.sum() == 0
    floats = np.arange(6, dtype=np.float32)
    raw_out = FakeDevice(np.zeros(24, np.uint8))
    c.Allreduce([FakeDevice(floats.copy()), "f"], [raw_out, "f"])   # typechar datatypes
    np.testing.assert_array_equal(raw_out.array.view(np.float32), floats)


def test_device_specs_mpi_alone_could_take_are_refused(comm) -> None:
    c, _ = comm
    x = FakeDevice(np.zeros(8, np.float32))
    with pytest.raises(TypeError, match="predefined MPI datatypes"):
        c.Allreduce([x, MPI.FLOAT.Create_contiguous(2)], FakeDevice(np.zeros(8, np.float32)))
    with pytest.raises(TypeError, match="does not fit"):
        c.Allreduce([x, 9, MPI.FLOAT], [FakeDevice(np.zeros(9, np.float32)), MPI.FLOAT])
    with pytest.raises(TypeError, match="device array .* host array"):
        c.Allreduce([x, MPI.FLOAT], [np.zeros(8, np.float32), MPI.FLOAT])
