"""Serial tests of mpicoll.Comm's hand-offs to MPI itself (buffer specs mpicoll does not
handle, vector counts other than array_split's) and its check of Reduce_scatter_block's
sizes, in a world of one rank."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpicoll


@pytest.fixture(name="comm")
def fixture_comm():
    """mpicoll's drop-in communicator over COMM_WORLD, with a derived datatype of one
    double in 16 bytes (a gap) and a user-defined MPI op (specs mpicoll leaves to MPI)."""
    derived = MPI.DOUBLE.Create_resized(0, 16).Commit()
    user_op = MPI.Op.Create(lambda a, b, t: None, commute=True)
    yield mpicoll.Comm(MPI.COMM_WORLD), derived, user_op
    user_op.Free()
    derived.Free()


def test_specs_mpicoll_does_not_handle_go_to_mpi(comm):
    """Every method hands a derived datatype or a user-defined op to MPI, which computes
    one rank's identity."""
    c, dt, user_op = comm
    x = np.arange(1.0, 5.0)
    for call in (lambda y: c.Reduce_scatter_block(x, y, user_op),
                 lambda y: c.Reduce_scatter(x, y, [4], user_op),
                 lambda y: c.Reduce(x, y, user_op, 0)):
        y = np.zeros(4)
        call(y)
        assert y.tolist() == x.tolist()
    y = np.zeros(4)
    c.Allgather([x, 2, dt], [y, 2, dt])     # every other double
    assert y.tolist() == [1.0, 0.0, 3.0, 0.0]
    buf = np.arange(4.0)
    c.Bcast([buf, 2, dt], root=0)
    assert buf.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_reduce_scatter_counts_other_than_array_splits_go_to_mpi(comm):
    """Reduce_scatter without counts or with counts mpicoll does not split by goes to MPI
    (which checks them itself)."""
    c = comm[0]
    x, y = np.arange(5.0), np.zeros(5)
    c.Reduce_scatter(x, y, [5])                  # array_split's: mpicoll's
    assert y.tolist() == x.tolist()
    y[:] = 0
    with pytest.raises(ValueError, match="mismatch in send count 5 and sum"):
        c.Reduce_scatter(x, y[:3], [3])          # counts that leave elements out: MPI's error
    assert not y.any()
    y[:] = 0
    c.Reduce_scatter(x, y, None)                 # no counts: MPI's (mpi4py's default)
    assert y.tolist() == x.tolist()


def test_reductions_of_different_send_and_receive_types_raise_as_in_mpi4py(comm):
    """A TypeError from mpicoll before; mpi4py's ValueError and words now."""
    c = comm[0]
    for call in (lambda: c.Allreduce(np.ones(3), np.zeros(3, np.float32)),
                 lambda: c.Reduce(np.ones(3), np.zeros(3, np.float32), root=0),
                 lambda: c.Reduce_scatter_block(np.ones(3), np.zeros(3, np.float32))):
        with pytest.raises(ValueError, match="mismatch in send and receive MPI datatypes"):
            call()


def test_reduce_scatter_block_sizes_must_match(comm):
    """sendbuf must hold size x recvbuf elements: ValueError naming both numbers."""
    c = comm[0]
    with pytest.raises(ValueError, match="sendbuf has 3 elements; Reduce_scatter_block "
                                         "needs size x recvbuf = 2"):
        c.Reduce_scatter_block(np.ones(3), np.zeros(2))
