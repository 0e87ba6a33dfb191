"""Serial tests of the stall inspector's pieces: its report of every peer's answer, its
answer to a peer's query, its abort message, and its refusal below THREAD_MULTIPLE; its
aborts (a call past the limit, a peer gone without the call), a peer's request to leave,
and the MPI errors it logs or drops a communicator over (fakes stand for the peers)."""
from __future__ import annotations

import logging
import sys
import threading
import types
import warnings

import pytest
from mpi4py import MPI

from mpicoll import watchdog
from mpicoll.tracking import CallInfo, Tracker

SUM = CallInfo("allreduce", 10, "<f4", "sum", None, "ring")


def watched(size: int, tracker: Tracker) -> types.SimpleNamespace:
    """A stand-in for :class:`watchdog.Watched` (rank 0) that records what it sends."""
    w = types.SimpleNamespace(rank=0, size=size, tracker=tracker, sent=[], answered=None,
                              answered_at=0.0, who=lambda r: f"rank {r}")
    w.send = lambda obj, dest, tag: w.sent.append((obj, dest, tag))
    return w


def test_report_files_each_peer_under_its_heading():
    """Every kind of answer lands under its own heading, and a peer that did not answer
    is named as such."""
    t = Tracker("w")
    for _ in range(3):
        t.begin(SUM)
    bcast = CallInfo("broadcast", 10, "<f4", None, 0, "binomial")
    smaller = SUM._replace(count=9)
    replies = {1: (3, 3, 2, bcast, {}),                     # in another collective
               2: (3, 3, 2, smaller, {}),                   # same one, other arguments
               3: (3, 4, 3, SUM, {}),                       # already in its next call
               4: (3, 3, 3, None, {})}                      # past it, in nothing now
    text = watchdog._report(watched(6, t), {"seq": 3, "replies": replies,
                                            "waited": 61.0})
    lines = text.splitlines()
    assert lines[0].startswith("mpicoll stall inspector: rank 0 has waited 61.0 s in "
                               "allreduce(") and lines[0].endswith("#3 on w (6 ranks)")
    heads = {line.split(":")[0].strip(): line for line in lines[1:]}
    assert "rank 1 in broadcast(" in heads["inside a different one"]
    assert "rank 3 in allreduce(" in heads["inside a different one"]
    assert "rank 2: count 9 (here 10)" in heads["disagree on its arguments"]
    assert heads["past it"].endswith("rank 4 (completed 3)")
    assert heads["did not answer"].endswith("rank 5")


def test_answer_logs_how_this_ranks_call_differs(caplog):
    """Answering a peer stalled in call #2: this rank in that call with other arguments,
    then (one call further) that its own call #2 differed; the reply is always sent."""
    t = Tracker("w")
    t.begin(SUM)
    t.done = 1
    t.begin(SUM._replace(op="max"))
    w = watched(2, t)
    with caplog.at_level(logging.WARNING, logger="mpicoll.stall"):
        watchdog._answer(w, 1, 2, SUM, 60.0)
        t.done = 2
        t.begin(SUM)
        watchdog._answer(w, 1, 2, SUM, 70.0)
    first, second = (r.getMessage() for r in caplog.records)
    assert first.endswith("this rank (rank 0) is in that call with other arguments: "
                          "op sum (here max)")
    assert "is in allreduce(" in second and second.endswith(
        "#3; its own call #2 differed: op sum (here max)")
    assert [(dest, tag) for _, dest, tag in w.sent] == [(1, watchdog._REPLY)] * 2


def test_abort_prints_the_message_then_ends_the_job(monkeypatch, capsys):
    """_abort writes its message to stderr (outside pytest's capture when there is one)
    and ends the job with status 1."""
    ended = []
    monkeypatch.setattr(watchdog.runtime_exit, "abort", ended.append)
    monkeypatch.delitem(sys.modules, "_pytest.capture")   # as outside pytest
    watchdog._abort("stalled: aborting")
    assert ended == [1] and capsys.readouterr().err == "stalled: aborting\n"


def test_abort_inside_pytest_suspends_its_capture(monkeypatch):
    """Inside pytest the message goes around the capture (suspended while it is written):
    the abort still follows."""
    ended = []
    monkeypatch.setattr(watchdog.runtime_exit, "abort", ended.append)
    watchdog._abort("stalled: aborting (test)")
    assert ended == [1]


def test_inspector_off_below_thread_multiple(monkeypatch):
    """Below MPI_THREAD_MULTIPLE the inspector is off, with one RuntimeWarning saying why."""
    monkeypatch.setattr(watchdog, "warn_seconds", lambda: 60.0)
    monkeypatch.setattr(watchdog, "_said_off", False)
    monkeypatch.setattr(watchdog, "MPI", types.SimpleNamespace(
        Query_thread=lambda: 1, THREAD_MULTIPLE=3))
    with pytest.warns(RuntimeWarning, match="stall inspector is off: MPI was initialized "
                                            "below MPI_THREAD_MULTIPLE"):
        assert watchdog.enabled() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert watchdog.enabled() is False   # said once


class FakeComm:
    """A watchdog communicator that delivers queued ``(source, tag, message)``."""

    def __init__(self, messages=()) -> None:
        self.messages = list(messages)

    def iprobe(self, source, tag, status) -> bool:
        if not self.messages:
            return False
        status.Set_source(self.messages[0][0])
        status.Set_tag(self.messages[0][1])
        return True

    def recv(self, source, tag):
        return self.messages.pop(0)[2]


class FailingRequest:
    """A pending send whose test fails with MPI error ``error_class``."""

    def __init__(self, error_class: int) -> None:
        self.error_class = error_class

    def Test(self) -> bool:
        raise MPI.Exception(self.error_class)


def polled(size: int, tracker: Tracker, messages=()) -> types.SimpleNamespace:
    """:func:`watched` with what ``_poll``, ``_check`` and ``announce_exit`` read."""
    w = watched(size, tracker)
    w.comm, w.sends, w.left, w.left_at, w.ended, w.asked = FakeComm(messages), [], {}, {}, \
        set(), {}
    w.seq, w.since, w.next_query, w.query, w.left_stuck_since = 0, 0.0, 0.0, None, None
    return w


def test_world_ranks_of_a_communicator_mpi_cannot_translate_are_its_own():
    """A communicator whose group MPI cannot give is taken to be the world's ranks."""
    def refuse():
        raise MPI.Exception(MPI.ERR_COMM)

    comm = types.SimpleNamespace(Get_group=refuse, Get_size=lambda: 3)
    assert watchdog._world_ranks(comm) == [0, 1, 2]


def test_into_skips_a_communicator_mpi_cannot_translate(monkeypatch):
    """_into leaves out a watched communicator whose group MPI cannot give."""
    def refuse():
        raise MPI.Exception(MPI.ERR_COMM)

    bad = types.SimpleNamespace(comm=types.SimpleNamespace(Get_group=refuse), size=1)
    good = types.SimpleNamespace(comm=MPI.COMM_SELF, size=1)
    monkeypatch.setattr(watchdog, "_watched", [bad, good])
    assert watchdog._into(MPI.COMM_SELF) == [(good, [0])]


def test_an_error_that_is_no_failure_keeps_the_communicator_watched(monkeypatch):
    """_drop_failed keeps watching after an MPI error that is no process failure."""
    w = polled(2, Tracker("w"))
    w.sends = [object()]
    monkeypatch.setattr(watchdog, "_watched", [w])
    assert watchdog._drop_failed(w, MPI.Exception(MPI.ERR_OTHER)) is False
    assert watchdog._watched == [w] and len(w.sends) == 1


def test_the_watchdog_thread_logs_an_mpi_error_and_goes_on(monkeypatch, caplog):
    """An MPI error while polling that is no failure is logged (debug), never raised, and
    the communicator stays watched."""
    w = polled(2, Tracker("w"))
    stop = threading.Event()

    def poll(w, now):
        stop.set()
        raise MPI.Exception(MPI.ERR_OTHER)

    monkeypatch.setattr(watchdog, "_watched", [w])
    monkeypatch.setattr(watchdog, "_stop", stop)
    monkeypatch.setattr(watchdog, "POLL_SECONDS", 0.001)
    monkeypatch.setattr(watchdog, "_poll", poll)
    with caplog.at_level(logging.DEBUG, logger="mpicoll.stall"):
        watchdog._loop()
    assert [r.getMessage().startswith("watchdog: ") for r in caplog.records] == [True]
    assert watchdog._watched == [w]


def test_a_peer_asking_for_an_ended_rank_calls_on_needed_unless_it_will_complete(
        monkeypatch):
    """A peer's request to leave reaches ``on_needed`` (naming the peer, its call and the
    communicator) unless this rank has since entered that call (it will complete); none
    is handled once the wait is over."""
    t = Tracker("w")
    t.begin(SUM)
    t.done = 1          # entered 1 call, completed it
    needed: list[str] = []
    monkeypatch.setattr(watchdog, "_on_needed", needed.append)
    w = polled(3, t, [(1, watchdog._NEEDED, (2, "allreduce #2")),
                      (2, watchdog._NEEDED, (1, "allreduce #1")),
                      (2, watchdog._NEEDED, (None, "negotiation"))])
    watchdog._poll(w, 0.0)
    assert needed == ["rank 1 waits for it in allreduce #2 on w",
                      "rank 2 waits for it in negotiation on w"]
    watchdog.end_over()
    w.comm.messages.append((1, watchdog._NEEDED, (2, "allreduce #2")))
    watchdog._poll(w, 0.0)
    assert len(needed) == 2 and not w.comm.messages


@pytest.mark.parametrize(("warn", "abort"), [("100", "0.5"), ("0.5", "1.0")])
def test_a_call_past_the_abort_limit_aborts_with_a_complete_report(monkeypatch, mpicoll_env,
                                                                   warn, abort):
    """MPICOLL_STALL_ABORT_SECONDS: a call waiting that long aborts the job, with the
    report of a query every peer answered (or whose answers' deadline passed): before,
    an abort limit below the warning's printed the headline alone, and one that was a
    multiple of it the report of a query sent in the same poll (every peer "did not
    answer")."""
    mpicoll_env(MPICOLL_STALL_WARN_SECONDS=warn, MPICOLL_STALL_ABORT_SECONDS=abort)
    aborted: list[str] = []
    monkeypatch.setattr(watchdog, "_abort", aborted.append)
    t = Tracker("w")
    t.begin(SUM)
    w = polled(2, t)
    watchdog._check(w, 10.0)            # starts timing call #1
    watchdog._check(w, 10.0 + float(abort) + 0.1)
    assert not aborted and w.query is not None     # asked; waits for the answer
    w.query["replies"][1] = (1, 0, 0, None, {})     # rank 1: not in any call
    watchdog._check(w, 10.0 + float(abort) + 0.2)
    (message,) = aborted
    assert message.startswith("mpicoll stall inspector: rank 0 has waited")
    assert "have not entered it: rank 1" in message and "did not answer" not in message
    assert message.endswith("aborting: waited longer than MPICOLL_STALL_ABORT_SECONDS="
                            + f"{float(abort):g}")


def test_a_bad_abort_variable_raises_where_the_inspector_starts(mpicoll_env):
    """A malformed MPICOLL_STALL_ABORT_SECONDS raises on the caller's thread (it ended
    the watchdog's thread, silently, at its first stalled call); NaN is refused too."""
    for bad in ("abc", "-1", "nan"):
        mpicoll_env(MPICOLL_STALL_WARN_SECONDS="5", MPICOLL_STALL_ABORT_SECONDS=bad)
        with pytest.raises(ValueError, match="MPICOLL_STALL_ABORT_SECONDS"):
            watchdog.enabled()


@pytest.mark.parametrize("elastic", [False, True])
def test_a_peer_gone_without_the_call_aborts_after_the_grace(monkeypatch, elastic):
    """A peer that left before completing the call in progress aborts the job
    LEFT_GRACE_SECONDS later, naming it and how far it got: it ended its process, or
    (elastic) ended its function and did not leave when asked NEEDED_GRACE_SECONDS ago."""
    aborted: list[str] = []
    monkeypatch.setattr(watchdog, "_abort", aborted.append)
    t = Tracker("w")
    t.begin(SUM)
    w = polled(2, t)
    w.left = {1: 0}
    if elastic:
        w.ended = {1}
        w.asked = {1: 0.0}
    watchdog._check_left(w, 1, 100.0, 5.0)
    assert not aborted and w.left_stuck_since == 100.0
    watchdog._check_left(w, 1, 100.0 + watchdog.LEFT_GRACE_SECONDS, 6.0)
    (message,) = aborted
    how = ("ended its elastic function and did not leave when asked" if elastic
           else "ended its process")
    assert message.endswith(f"\n  rank 1 (after completing 0 collectives on it) {how} and "
                            f"will never take part in it: aborting the job")
    assert message.startswith("mpicoll stall inspector: rank 0 has waited 6.0 s")


def test_exit_announcement_returns_once_mpi_is_finalized(monkeypatch):
    """announce_exit sends nothing once MPI is finalized."""
    w = polled(2, Tracker("w"))
    monkeypatch.setattr(watchdog, "_watched", [w])
    monkeypatch.setattr(watchdog, "_thread", None)
    monkeypatch.setattr(watchdog, "_stop", threading.Event())
    monkeypatch.setattr(watchdog.MPI, "Is_finalized", lambda: True)
    watchdog.announce_exit()
    assert not w.sent


@pytest.mark.parametrize("failed", [False, True])
def test_a_send_that_fails_at_exit_is_logged_or_its_communicator_dropped(monkeypatch,
                                                                         caplog, failed):
    """At exit a pending notice that fails: with a process failure (ULFM) the
    communicator is no longer watched and its sends are kept, never freed; with another
    MPI error it is logged and the notices are still collected."""
    w = polled(2, Tracker("w"))
    request = FailingRequest(MPI.ERR_OTHER)
    w.send = lambda obj, dest, tag: (w.sent.append((obj, dest, tag)), w.sends.append(request))
    monkeypatch.setattr(watchdog, "_watched", [w])
    monkeypatch.setattr(watchdog, "_thread", None)
    monkeypatch.setattr(watchdog, "_stop", threading.Event())
    monkeypatch.setattr(watchdog, "EXIT_WAIT_SECONDS", 0.05)
    monkeypatch.setattr(watchdog.failures, "failed_by",
                        lambda exc, comm: [1] if failed else None)
    kept: list = []
    monkeypatch.setattr(watchdog.failures, "keep_requests", kept.extend)
    with caplog.at_level(logging.DEBUG, logger="mpicoll.stall"):
        watchdog.announce_exit()
    assert [(dest, tag) for _, dest, tag in w.sent] == [(1, watchdog._LEFT)]
    messages = [r.getMessage() for r in caplog.records]
    if failed:
        assert watchdog._watched == [] and kept == [request] and w.sends == []
        assert messages == [f"watchdog: {MPI.Exception(MPI.ERR_OTHER)}; no longer watched"]
    else:
        assert watchdog._watched == [w] and not kept
        assert messages and all(m == f"watchdog: {MPI.Exception(MPI.ERR_OTHER)}"
                                for m in messages)
