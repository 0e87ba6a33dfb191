"""Which threads wait for MPI with sleeps (mpicoll.waiting): a runtime lane's thread by
default, the Horovod engine's lane and the caller's thread never; MPICOLL_LANE_WAIT
overrides, and a bad value is refused with its name. One process (the MPI suites run the
collectives on sleeping threads: tests/mpi/test_waiting.py)."""
from __future__ import annotations

import pytest

from mpicoll import config, waiting
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
