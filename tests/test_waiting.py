"""Which threads wait for MPI with sleeps (mpicoll.waiting): a runtime lane's thread by
default, the Horovod engine's lane and the caller's thread never; MPICOLL_LANE_WAIT
overrides, and a bad value is refused with its name; a lane's timeout bounds each of its
operations' waits, which poll then even where they do not sleep. One process (the MPI suites run the
collectives on sleeping threads: tests/mpi/test_waiting.py)."""
from __future__ import annotations

import time

import pytest
from mpi4py import MPI

from mpicoll import config, waiting
from mpicoll.errors import CollectiveTimeoutError
from mpicoll.runtime import failures
from mpicoll.runtime.progress import Lane


@pytest.fixture
def lane_wait(monkeypatch):
    def set_(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv("MPICOLL_LANE_WAIT", raising=False)
        else:
            monkeypatch.setenv("MPICOLL_LANE_WAIT", value)
        config.refresh()
    yield set_
    monkeypatch.delenv("MPICOLL_LANE_WAIT", raising=False)
    config.refresh()


def lane_thread_sleeps(**kwargs) -> bool:
    lane = Lane("test-waiting", inline=False, **kwargs)
    try:
        return lane.submit("probe", waiting.sleeps).wait(30)
    finally:
        lane.close(10)


@pytest.mark.parametrize("setting,lane,engine", [(None, True, False), ("auto", True, False),
                                                 ("sleep", True, True),
                                                 ("spin", False, False)])
def test_lane_threads_sleep_as_set(lane_wait, setting, lane, engine):
    lane_wait(setting)
    assert lane_thread_sleeps() is lane
    assert lane_thread_sleeps(sleeps=False) is engine    # the Horovod engine's lane
    assert waiting.sleeps() is False                      # this (the caller's) thread


def test_a_bad_setting_is_refused_with_its_name(lane_wait):
    lane_wait("nap")
    with pytest.raises(ValueError, match="MPICOLL_LANE_WAIT='nap'"):
        Lane("test-waiting", inline=False)


@pytest.mark.parametrize("naps,sleeps", [(True, True), (False, True), (True, False)])
def test_an_operation_whose_wait_passes_the_lanes_timeout_fails_and_breaks_the_lane(naps,
                                                                                     sleeps):
    """A lane's timeout bounds each operation, not only ``Work.wait``: a sleeping wait
    still polling at the deadline raises, the work fails with CollectiveTimeoutError
    (nobody waited with a timeout), the lane is broken and knows an operation was left in
    MPI, and the request is kept, never freed. On the lane's thread and on the caller's
    (``here``); with and without the wait's sleeps, and on a lane that waits on the core
    (``sleeps=False``: its deadline makes it poll rather than block in MPI). The test
    cancels the abandoned receive itself (else the exit handler would end the job, as it
    must)."""
    buf = bytearray(1)
    for here in (False, True):
        lane = Lane("test-deadline", inline=False, timeout=0.3, sleeps=sleeps)
        request = MPI.COMM_WORLD.Irecv(buf, source=MPI.COMM_WORLD.Get_rank(), tag=4242)
        start = time.monotonic()
        work = lane.submit("never matched", lambda r=request: waiting.wait(r, naps), here=here)
        with pytest.raises(CollectiveTimeoutError, match="never matched on test-deadline "
                                                         "timed out after 0.3 s"):
            work.wait(30)
        assert 0.25 < time.monotonic() - start < 5
        assert lane.broken is work.exception() and lane.abandoned and lane.in_mpi()
        assert any(r is request for r in failures._orphans)
        assert waiting.set_deadline(float("inf")) == float("inf")   # restored after it
        request.Cancel()
        request.Wait()
        failures._orphans.remove(request)
        lane.abandoned = False
        lane.close(10)
