"""Shutdown is Horovod's: one rank's ``hvd.shutdown()`` (or its exit) fails the other ranks'
pending and later operations promptly, with an error naming it; never a hang.

Each test ends with every rank re-initialized (``hvd.init()`` after a shutdown starts
afresh), so the session's engine is usable again for the next test.
"""
from __future__ import annotations

import time

import pytest
import torch
from mpi4py import MPI

import mpicoll.torch as hvd

pytestmark = pytest.mark.mpi

#: The bound this suite holds the adapter to, in seconds: a rank waiting in an operation
#: gets its error, and a rank that shuts down returns, within it (measured: a few ms on a
#: loaded 2-core machine; an idle engine looks for the shutdown notice every 0.05 s).
BOUND = 3.0


def _left_message(rank: int) -> str:
    return (rf"shut down by rank {rank} \(it called hvd.shutdown\(\)\)\. As in Horovod, "
            r"this is caused by an exception on one of the ranks")


@pytest.fixture
def fresh():
    """Skip below 2 ranks; afterwards start mpicoll.torch again on every rank."""
    if hvd.size() < 2:
        pytest.skip("needs 2 ranks")
    yield hvd.size() - 1
    hvd.shutdown()
    hvd.init()
    hvd.barrier()


def test_shutdown_fails_the_operation_other_ranks_wait_in(fresh):
    last = fresh
    if hvd.rank() == last:
        time.sleep(0.3)                     # the others wait in the all-reduce by now
        start = time.monotonic()
        hvd.shutdown()
        assert time.monotonic() - start < BOUND
        assert not hvd.is_initialized()
        return
    start = time.monotonic()
    with pytest.raises(hvd.CollectiveError,
                       match=r"allreduce 'left\.x' failed: mpicoll\.torch has been "
                             + _left_message(last)):
        hvd.allreduce(torch.ones(3), name="left.x")
    assert time.monotonic() - start < 0.3 + BOUND
    assert not hvd.is_initialized()
    # later operations fail the same way, at once
    with pytest.raises(hvd.CollectiveError, match=r"broadcast 'left\.y' failed: .*"
                       + _left_message(last)):
        hvd.broadcast(torch.ones(3), root_rank=0, name="left.y")


def test_shutdown_reaches_ranks_busy_elsewhere(fresh):
    # The other ranks make no adapter call for a while: the leaving rank's exit does not
    # wait for them (its notice wakes their engine threads), their next call fails.
    last = fresh
    if hvd.rank() == last:
        start = time.monotonic()
        hvd.shutdown()
        assert time.monotonic() - start < 1.5, "shutdown waited for the busy ranks"
        return
    time.sleep(2.0)
    assert not hvd.is_initialized()
    with pytest.raises(hvd.CollectiveError, match=_left_message(last)):
        hvd.allreduce(torch.ones(3), name="busy.x")


def test_pending_handles_fail_on_every_rank_with_their_names(fresh):
    last, me = fresh, hvd.rank()
    handle = hvd.allreduce_async(torch.ones(2), name=f"own.{me}")   # never matched
    MPI.COMM_WORLD.Barrier()                # every rank has submitted before the shutdown
    if me == last:
        hvd.shutdown()
        who = r"by this rank \(it called hvd.shutdown\(\)\)"
    else:
        who = _left_message(last)
    with pytest.raises(hvd.CollectiveError,
                       match=rf"allreduce 'own\.{me}' failed: .*{who}"):
        hvd.synchronize(handle)


def test_init_after_another_ranks_shutdown_starts_again(fresh):
    """``hvd.init()`` on a rank whose adapter another rank's shutdown stopped (without a
    ``hvd.shutdown()`` of its own) starts it afresh, as after a shutdown."""
    last = fresh
    if hvd.rank() == last:
        hvd.shutdown()
    else:
        deadline = time.monotonic() + BOUND
        while hvd.is_initialized() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not hvd.is_initialized()
    MPI.COMM_WORLD.Barrier()
    hvd.init()
    assert hvd.is_initialized()
    out = hvd.allreduce(torch.full((2,), float(hvd.rank())), op=hvd.Sum, name="restarted")
    assert torch.equal(out, torch.full((2,), float(sum(range(hvd.size())))))


def test_shutdown_on_every_rank_then_init_again():
    for stagger in (0.0, 0.2):
        time.sleep(stagger * hvd.rank())
        hvd.shutdown()
        assert not hvd.is_initialized()
        hvd.shutdown()                      # a no-op
        hvd.init()
        assert hvd.is_initialized()
        out = hvd.allreduce(torch.ones(2), op=hvd.Sum, name=f"again.{stagger}")
        assert torch.equal(out, torch.full((2,), float(hvd.size())))
