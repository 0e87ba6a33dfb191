"""Serial tests of mpicoll.runtime.failures and mpicoll.runtime.exit off their usual
paths: MPI calls that fail while asking about failures (a freed communicator, a library
without ULFM), an agreement that fails for another reason, a guarded call's own error, a
revocation by a peer whose client broke while no process failed (ULFM simulated), and the
exit helpers on closed streams, non-pipes and an MPI already finalized."""
from __future__ import annotations

import logging
import os
import threading
import types

import pytest
from mpi4py import MPI

from mpicoll.errors import CollectiveError, ProcessFailedError
from mpicoll.runtime import exit as runtime_exit
from mpicoll.runtime import failures, world


def test_ulfm_is_unavailable_without_its_functions_or_a_library_to_ask(monkeypatch):
    """available(): no MPIX_Comm_revoke / MPIX_Comm_get_failed, or a library version MPI
    cannot give, means no ULFM; Open MPI with both means ULFM."""
    def library(version):
        def get() -> str:
            if isinstance(version, Exception):
                raise version
            return version
        return get

    class WithUlfm:
        Revoke = Get_failed = None

    fake = types.SimpleNamespace(Comm=object, Get_library_version=library("Open MPI v5"))
    monkeypatch.setattr(failures, "MPI", fake)
    assert not failures.available()
    fake.Comm = WithUlfm
    assert failures.available()
    fake.Get_library_version = library(MPI.Exception(MPI.ERR_OTHER))
    assert not failures.available()
    fake.Get_library_version = library("MPICH Version: 5")
    assert not failures.available()


def test_an_mpi_error_whose_class_cannot_be_read_is_no_failure(monkeypatch):
    """An MPI error whose class MPI cannot give is not classified (not a failure) even
    under ULFM."""
    class Unreadable(MPI.Exception):
        def Get_error_class(self) -> int:
            raise MPI.Exception(MPI.ERR_ARG)

    monkeypatch.setattr(failures, "ENABLED", True)
    exc = Unreadable(MPI.ERR_OTHER)
    assert failures._error_class(exc) is None
    assert failures.failed_by(exc, None) is None and failures.translate(exc, None) is exc


def test_driving_progress_ignores_an_mpi_that_refuses(monkeypatch):
    """_progress (which lets MPI deliver failure notices) swallows MPI's error."""
    calls = []

    def iprobe(source, tag):
        calls.append((source, tag))
        raise MPI.Exception(MPI.ERR_OTHER)

    monkeypatch.setattr(failures, "MPI", types.SimpleNamespace(
        COMM_SELF=types.SimpleNamespace(Iprobe=iprobe), ANY_SOURCE=-1, ANY_TAG=-2))
    failures._progress()
    assert calls == [(-1, -2)]


def test_questions_about_a_freed_communicator_have_safe_answers():
    """A freed communicator (COMM_NULL): not revoked, acknowledging and revoking it do
    nothing, and its ranks stay as given when they cannot be translated."""
    assert failures.revoked(MPI.COMM_NULL) is False
    failures.acknowledge(MPI.COMM_NULL)
    failures.revoke_only(MPI.COMM_NULL)
    assert failures._world_ranks(MPI.COMM_NULL, [2, 1], world.generation()) == [2, 1]


def test_an_agreement_that_fails_for_another_reason_raises():
    """agreement_over: a process failure completes the agreement; any other MPI error is
    the caller's, raised."""
    class Request:
        def __init__(self, error_class: int) -> None:
            self.error_class = error_class

        def Test(self) -> bool:
            raise MPI.Exception(self.error_class)

    assert failures.agreement_over(Request(failures.PROC_FAILED)) is True
    with pytest.raises(MPI.Exception) as info:
        failures.agreement_over(Request(MPI.ERR_TRUNCATE))
    assert info.value.Get_error_class() == MPI.ERR_TRUNCATE


def test_a_guarded_call_raises_its_own_error_when_it_is_no_failure():
    """guard(): an MPI error that is no process failure is re-raised unchanged."""
    def call(comm):
        raise MPI.Exception(MPI.ERR_TRUNCATE)

    guarded = failures.guard(call)
    with pytest.raises(MPI.Exception) as info:
        guarded(MPI.COMM_WORLD)
    assert info.value.Get_error_class() == MPI.ERR_TRUNCATE and guarded.__wrapped__ is call


def test_a_guarded_call_translates_any_error_once_a_peer_failed(monkeypatch):
    """guard(): an error that is not MPI's (mpi4py's unpickling of an object collective a
    dead peer cut short) is a ProcessFailedError naming the failed rank while MPI knows
    one; with no failure known it passes unchanged (a bad argument, at once)."""
    import pickle

    def call(comm):
        raise pickle.UnpicklingError("invalid load key, '\\x00'.")

    guarded = failures.guard(call)
    monkeypatch.setattr(failures, "ENABLED", True)
    monkeypatch.setattr(failures, "fail_world", lambda *a: None)
    known: list[int] = []
    monkeypatch.setattr(failures, "failed_ranks",
                        lambda comm, wait_s=1.0, progress=False: list(known))
    with pytest.raises(pickle.UnpicklingError):
        guarded(MPI.COMM_WORLD)
    known.append(2)
    with pytest.raises(ProcessFailedError) as info:
        guarded(MPI.COMM_WORLD)
    assert info.value.failed_ranks == [2]
    assert isinstance(info.value.__cause__, pickle.UnpicklingError)


def test_a_revocation_while_no_process_failed_breaks_only_that_communicator(monkeypatch):
    """Under ULFM, MPI_ERR_REVOKED while MPI names no failed rank and the world is
    healthy comes from a peer whose client broke (a timeout or abort): a CollectiveError
    saying so, chained from MPI's; the communicator (only it) is revoked here too and the
    world stays healthy."""
    monkeypatch.setattr(failures, "ENABLED", True)
    monkeypatch.setattr(failures, "failed_ranks", lambda comm, wait_s=1.0, progress=False: [])
    revoked = []
    monkeypatch.setattr(failures, "revoke_only", revoked.append)
    monkeypatch.setattr(failures, "fail_world", lambda *a: pytest.fail("world failed"))
    exc = MPI.Exception(MPI.ERR_REVOKED)
    error = failures.translate(exc, MPI.COMM_WORLD, "allreduce")
    assert type(error) is CollectiveError and error.__cause__ is exc
    assert str(error).startswith("allreduce ended: another rank revoked the communicator "
                                 "(a timeout or an abort there broke it; no process failed)")
    assert revoked == [MPI.COMM_WORLD]
    assert not world.failed(world.generation())


def test_a_failed_creation_without_ulfm_is_no_process_failure(monkeypatch):
    """Without ULFM creation_failure never makes a ProcessFailedError (MPI's error
    stands), whatever the error's class."""
    monkeypatch.setattr(failures, "ENABLED", False)
    exc = MPI.Exception(failures.PROC_FAILED)
    assert failures.creation_failure(exc, MPI.COMM_WORLD, [0]) is None
    assert failures.creation_failure(ProcessFailedError("x", [1]), MPI.COMM_WORLD, []) is None


def test_flush_ignores_a_closed_stream(monkeypatch, tmp_path):
    """flush() (before the process ends at once) passes over a closed stdout and still
    flushes stderr."""
    closed = open(tmp_path / "out", "w")   # noqa: SIM115  (closed at once)
    closed.close()
    err = open(tmp_path / "err", "w")      # noqa: SIM115  (closed below)
    err.write("pending")
    monkeypatch.setattr(logging, "shutdown", lambda: None)
    monkeypatch.setattr("sys.stdout", closed)
    monkeypatch.setattr("sys.stderr", err)
    runtime_exit.flush()
    assert (tmp_path / "err").read_text() == "pending"
    err.close()


def test_only_a_pipe_has_unread_bytes(tmp_path):
    """_unread: a regular file and a closed descriptor count 0 bytes; a pipe counts what
    its reader has not read."""
    with open(tmp_path / "f", "wb") as f:
        f.write(b"abc")
        f.flush()
        assert runtime_exit._unread(f.fileno()) == 0
    read, write = os.pipe()
    os.write(write, b"abcd")
    assert runtime_exit._unread(write) == 4
    os.close(read)
    os.close(write)
    assert runtime_exit._unread(write) == 0


def test_nothing_is_finalized_twice(monkeypatch):
    """An MPI that cannot say whether it is finalized counts as not finalized;
    finalize_bounded starts no finalizer when MPI is finalized or was never initialized,
    and the exit handler does nothing once MPI is finalized."""
    def refuse() -> bool:
        raise MPI.Exception(MPI.ERR_OTHER)

    monkeypatch.setattr(runtime_exit.MPI, "Is_finalized", refuse)
    assert runtime_exit._finalized() is False
    monkeypatch.setattr(threading, "Thread", lambda *a, **k: pytest.fail("finalizer"))
    monkeypatch.setattr(runtime_exit.MPI, "Is_initialized", lambda: False)
    assert runtime_exit.finalize_bounded(0.1) is True
    monkeypatch.setattr(runtime_exit.MPI, "Is_finalized", lambda: True)
    assert runtime_exit.finalize_bounded(0.1) is True
    released = []
    monkeypatch.setattr(runtime_exit.comms, "release_all", lambda: released.append(1))
    runtime_exit._at_exit()
    assert not released


def test_a_communicator_that_cannot_be_revoked_does_not_stop_the_others(monkeypatch):
    """revoke(): MPI refusing to revoke one communicator (already freed or revoked) is
    ignored and the world's other communicators are still revoked (MPI stands in: no
    real revocation here)."""
    tried = []

    def plain(comm):
        def revoke():
            tried.append(comm)
            raise MPI.Exception(MPI.ERR_COMM)
        return types.SimpleNamespace(Revoke=revoke)

    monkeypatch.setattr(failures, "_plain", plain)
    monkeypatch.setattr(failures.comms, "of_world", lambda gen: [])
    monkeypatch.setattr(failures.comms, "world_of", lambda comm: world.generation())
    failures.revoke(MPI.COMM_SELF)
    assert tried == [MPI.COMM_SELF, world.comm()]
