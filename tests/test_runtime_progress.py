"""Serial tests of mpicoll.runtime.progress's less travelled paths: a callback that raises,
a broken lane refusing work (with ULFM, and by ending the job without), a caller waiting
to run ``here`` while the lane breaks, the lane's thread held back by such a caller, a
timeout report whose ``missing`` callable fails, the exit handler ending the job, and
:func:`create`'s stuck and plain failures under (simulated) ULFM."""
from __future__ import annotations

import logging
import threading
import time
import weakref

import pytest

from mpicoll.errors import CollectiveTimeoutError, ProcessFailedError
from mpicoll.runtime import failures, progress
from mpicoll.runtime.progress import Lane, Work


@pytest.fixture
def ended(monkeypatch):
    """The statuses the job was ended with (``runtime_exit.abort`` records instead)."""
    statuses: list[int] = []
    monkeypatch.setattr(progress.runtime_exit, "abort", statuses.append)
    return statuses


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_callback_that_raises_is_logged_and_the_others_still_run(caplog):
    """A done callback's own error is logged (naming the work) and never reaches the
    completer; later callbacks still run, before and after completion."""
    work, seen = Work("probe"), []

    def bad(_):
        raise ValueError("callback broke")

    work.add_done_callback(bad)
    work.add_done_callback(seen.append)
    with caplog.at_level(logging.ERROR, logger="mpicoll.runtime"):
        assert work.finish(7)
        work.add_done_callback(bad)        # already done: runs here, logged again
    assert seen == [work] and work.wait(1) == 7
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["mpicoll: a callback of probe raised"] * 2
    assert all(isinstance(r.exc_info[1], ValueError) for r in caplog.records)


def test_a_broken_lane_refuses_work_with_its_error_under_ulfm(monkeypatch, ended):
    """Under ULFM a submission to a broken lane completes at once with the lane's error;
    the operation never runs and the job goes on."""
    monkeypatch.setattr(failures, "ENABLED", True)
    monkeypatch.setattr(failures, "_left", [])
    lane, ran = Lane("refusing", inline=False), []
    error = RuntimeError("broke")
    lane.abort(error)
    work = lane.submit("later", lambda: ran.append(1))
    assert work.done() and work.exception() is error and not ran and not ended
    with pytest.raises(RuntimeError, match="broke"):
        work.wait(1)


def test_a_broken_lane_without_ulfm_ends_the_job(monkeypatch, ended, capsys):
    """Without ULFM, using a broken lane again ends the job, saying which operation on
    which lane and why (the work still fails if the end returns, as the fake does)."""
    monkeypatch.setattr(failures, "ENABLED", False)
    lane = Lane("refusing", inline=False)
    lane.abort(RuntimeError("broke"))
    work = lane.submit("later", lambda: None)
    assert ended == [1]
    assert capsys.readouterr().err == ("mpicoll: later on refusing, which is broken: broke; "
                                       "ending the job\n")
    assert isinstance(work.exception(), RuntimeError)


def test_end_job_logs_only_where_a_handler_listens(monkeypatch, ended, capsys, caplog):
    """_end_job prints to stderr, and logs too only where the logger has a handler (else
    logging's last resort would print it twice)."""
    monkeypatch.setattr(progress.log, "hasHandlers", lambda: False)
    progress._end_job("stuck")
    assert capsys.readouterr().err == "mpicoll: stuck; ending the job\n" and not caplog.records
    monkeypatch.setattr(progress.log, "hasHandlers", lambda: True)
    with caplog.at_level(logging.ERROR, logger="mpicoll.runtime"):
        progress._end_job("stuck again")
    assert [r.getMessage() for r in caplog.records] == ["mpicoll: stuck again; ending the job"]
    assert ended == [1, 1]


def test_a_caller_waiting_to_run_here_gets_the_error_when_the_lane_breaks(monkeypatch,
                                                                          ended):
    """A ``here`` submission waiting for the lane's operation before it gives up when the
    lane breaks meanwhile: its operation never runs, it is queued and failed with the
    lane's error by the lane's thread, which is then idle."""
    monkeypatch.setattr(failures, "ENABLED", False)
    lane = Lane("here-broken", inline=False)
    release = threading.Event()
    first = lane.submit("first", lambda: release.wait(30))
    wait_for(lambda: lane._running is first)
    ran, result = [], []
    caller = threading.Thread(
        target=lambda: result.append(lane.submit("mine", lambda: ran.append(1), here=True)))
    caller.start()
    wait_for(lambda: len(lane._idle._waiters) == 1)    # the caller waits for the lane
    error = RuntimeError("lane broke")
    lane.abort(error)
    caller.join(10)
    (work,) = result
    assert not work.done()                  # queued behind the operation still in MPI
    release.set()
    with pytest.raises(RuntimeError, match="lane broke"):
        work.wait(10)
    assert not ran and first.exception() is error and not ended
    wait_for(lambda: lane._running is None and not lane._pending)
    assert lane.close(10)


def test_the_lanes_thread_waits_for_a_caller_running_here():
    """While a caller runs an operation ``here``, an operation submitted behind it waits
    on the lane's thread until the caller's ends (they never run at the same time)."""
    lane = Lane("here-first", inline=False)
    lane.submit("start", lambda: None).wait(10)         # the lane's thread is up
    release, started, order = threading.Event(), threading.Event(), []

    def mine():
        started.set()
        release.wait(30)
        order.append("mine")

    caller = threading.Thread(target=lambda: lane.submit("mine", mine, here=True))
    caller.start()
    assert started.wait(10)
    queued = lane.submit("queued", lambda: order.append("queued"))
    wait_for(lambda: len(lane._idle._waiters) == 1)     # the lane's thread is held back
    assert not queued.done()
    release.set()
    queued.wait(10)
    caller.join(10)
    assert order == ["mine", "queued"]
    assert lane.close(10)


def test_a_failing_missing_report_leaves_the_timeout_unnamed():
    """A lane's ``missing`` callable that raises does not hide the timeout: the error
    names no rank, and the lane is broken with it."""
    lane = Lane("reporting", inline=False, missing=lambda work: 1 / 0)
    work = Work("allreduce", lane)
    error = lane.timed_out(work, 0.5)
    assert isinstance(error, CollectiveTimeoutError) and error.missing == []
    assert "did not arrive" not in str(error) and lane.broken is error
    assert str(error).startswith("mpicoll: allreduce on reporting timed out after 0.5 s; "
                                 "reporting is broken")


def test_closing_a_broken_lane_left_in_mpi_without_ulfm_ends_the_job(monkeypatch, ended,
                                                                     capsys):
    """Without ULFM a broken lane whose operation is still in MPI cannot be closed: the
    job ends, naming the lane and its error."""
    monkeypatch.setattr(failures, "ENABLED", False)
    lane = Lane("abandoned", inline=False)
    lane.abort(RuntimeError("timed out"))
    lane.abandoned = True
    assert lane.close(1)
    assert ended == [1]
    assert "mpicoll: abandoned closed while broken: timed out; ending the job" in \
        capsys.readouterr().err


def test_exit_ends_the_job_for_a_broken_lane_and_for_a_stuck_one(monkeypatch, ended,
                                                                 capsys):
    """The exit handler ends the job for a broken lane still in MPI (without ULFM) and
    for a lane whose thread made no progress for EXIT_STALL_S, naming each."""
    monkeypatch.setattr(failures, "ENABLED", False)
    monkeypatch.setattr(progress, "EXIT_STALL_S", 0.2)
    broken = Lane("broken-lane", inline=False)
    broken.abort(RuntimeError("timed out"))
    broken.abandoned = True
    stuck = Lane("stuck-lane", inline=False)
    release = threading.Event()
    stuck.submit("never joined", lambda: release.wait(30))
    monkeypatch.setattr(progress, "_lanes", weakref.WeakSet([broken, stuck]))
    progress._close_all_at_exit()
    err = capsys.readouterr().err
    assert "at exit, broken-lane is broken: timed out; ending the job" in err
    assert "at exit, stuck-lane made no progress for 0.2 s (an operation the other ranks " \
           "never joined); ending the job" in err
    assert ended.count(1) >= 2
    release.set()
    assert stuck.close(10)


def test_create_revokes_what_it_made_when_a_member_fails(monkeypatch):
    """Under ULFM a creation still running CREATE_GRACE_S after MPI reports a member
    failed is given up: the communicators made so far are revoked and the caller gets
    the ProcessFailedError that creation_failure makes of it."""
    monkeypatch.setattr(failures, "ENABLED", True)
    monkeypatch.setattr(failures, "_left", [])
    monkeypatch.setattr(progress, "CREATE_GRACE_S", 0.05)
    monkeypatch.setattr(failures, "failed_ranks", lambda comm, wait_s=0.0, progress=False: [2])
    revoked, seen = [], []
    monkeypatch.setattr(failures, "revoke", revoked.append)

    def creation_failure(exc, parent, members, created):
        seen.append((exc, parent, members, created))
        return ProcessFailedError("creation failed", [1])

    monkeypatch.setattr(failures, "creation_failure", creation_failure)
    release = threading.Event()

    def build(made):
        made.append("first-comm")
        release.wait(30)

    with pytest.raises(ProcessFailedError, match="creation failed") as info:
        progress.create(build, "parent", [0, 2], "new_group")
    release.set()
    assert revoked == ["first-comm"]
    ((exc, parent, members, created),) = seen
    assert isinstance(exc, ProcessFailedError) and exc.failed_ranks == [2]
    assert "new_group: creation stuck on failed member(s)" in str(exc)
    assert (parent, members, created) == ("parent", [0, 2], "first-comm")
    assert info.value.__cause__ is exc


def test_create_passes_an_error_that_is_no_process_failure(monkeypatch):
    """Under ULFM, an error of ``build`` while no member is known to have failed is no
    process failure: creation_failure says so and the error itself is raised."""
    monkeypatch.setattr(failures, "ENABLED", True)
    monkeypatch.setattr(failures, "failed_ranks", lambda comm, wait_s=0.0, progress=False: [])

    def build(made):
        raise ValueError("bad group")

    with pytest.raises(ValueError, match="bad group"):
        progress.create(build, "parent", [0, 1], "new_group")


def test_a_submission_racing_close_runs_or_is_refused_never_orphaned():
    """Two threads submit while a third closes the lane: every submission either runs
    before the lane's thread stops or raises "shut down" (one queued behind close()'s
    end marker was never run: its wait took the whole timeout; one whose thread
    started after close() ran on communicators already freed). Close's stall check
    counts from the last completed operation."""
    for round_ in range(300):
        lane = Lane(f"race-{round_}", inline=False)
        works: list[Work] = []
        refused = []
        go = threading.Barrier(3)

        def submitter(lane=lane, works=works, refused=refused, go=go) -> None:
            go.wait()
            for _ in range(40):
                try:
                    works.append(lane.submit("op", lambda: 1))
                except RuntimeError as exc:
                    refused.append(str(exc))
                    return

        threads = [threading.Thread(target=submitter) for _ in range(2)]
        for t in threads:
            t.start()
        go.wait()
        time.sleep(0.0002 * (round_ % 7))
        assert lane.close(5.0)
        for t in threads:
            t.join()
        assert all(w.done() for w in works), f"round {round_}: an orphaned work"
        assert all("which was shut down" in r for r in refused)


def test_close_reports_a_stall_counted_from_the_last_progress():
    """A lane whose operation hangs: close(stall_s) gives up stall_s after the last
    operation completed, not up to twice that."""
    lane, release = Lane("stall", inline=False), threading.Event()
    lane.submit("quick", lambda: time.sleep(0.05))
    lane.submit("stuck", release.wait)
    began = time.monotonic()
    assert not lane.close(0.5)
    assert time.monotonic() - began < 0.05 + 0.5 + 0.2    # (it took 1.0: two windows)
    release.set()
    assert lane.close(5.0)
