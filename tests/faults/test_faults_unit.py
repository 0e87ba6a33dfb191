"""mpicoll.runtime.failures without ULFM (the MPICH venv, one process): the error class,
the classification of MPI errors, and that nothing is wrapped when ULFM is off."""
from __future__ import annotations

import threading
import time

from mpi4py import MPI

import mpicoll
from mpicoll import collectives, compression
from mpicoll.comm import Comm
from mpicoll.runtime import Lane, failures


def test_process_failed_error_is_a_collective_error_naming_the_ranks() -> None:
    exc = mpicoll.ProcessFailedError("rank 3 failed", [3, 1])
    assert isinstance(exc, mpicoll.CollectiveError)
    assert exc.failed_ranks == [1, 3]
    assert "ProcessFailedError" in mpicoll.__all__


def test_turned_on_reads_the_ft_variable(monkeypatch) -> None:
    for name in ("OMPI_MCA_mpi_ft_enable", "mpi_ft_enable"):
        monkeypatch.delenv(name, raising=False)
    assert not failures.turned_on()
    monkeypatch.setenv("OMPI_MCA_mpi_ft_enable", "1")
    assert failures.turned_on()
    monkeypatch.setenv("OMPI_MCA_mpi_ft_enable", "0")
    assert not failures.turned_on()


def test_ulfm_is_off_here_and_nothing_is_wrapped() -> None:
    if "Open MPI" not in MPI.Get_library_version():  # the MPICH wheel: no working ULFM
        assert not failures.available()
    if not failures.ENABLED:
        for fn in (mpicoll.allreduce, mpicoll.allreduce_init, mpicoll.reduce_scatter,
                   mpicoll.allgather, mpicoll.broadcast, mpicoll.reduce,
                   compression.allreduce, compression.allgather, compression.reduce_scatter,
                   Comm.Allreduce, Comm.Bcast):
            assert not hasattr(fn, "__wrapped__"), fn
        assert mpicoll.allreduce is collectives._PUBLIC["allreduce"]


def test_without_ulfm_nothing_is_translated() -> None:
    if failures.ENABLED:
        return
    exc = MPI.Exception(failures.PROC_FAILED)
    assert failures.failed_by(exc, None) is None
    assert failures.translate(exc, None) is exc


def test_only_process_failures_are_translated(monkeypatch) -> None:
    monkeypatch.setattr(failures, "ENABLED", True)   # classify as under ULFM
    assert failures.failed_by(ValueError("x"), None) is None
    assert failures.failed_by(MPI.Exception(MPI.ERR_TRUNCATE), None) is None
    truncate = MPI.Exception(MPI.ERR_TRUNCATE)
    assert failures.translate(truncate, None) is truncate    # not a failure: itself
    for name in ("ERR_PROC_FAILED", "ERR_REVOKED"):
        if hasattr(MPI, name):
            assert failures.failed_by(MPI.Exception(getattr(MPI, name)), None) == [], name


def test_left_in_mpi_names_the_operations_still_running_after_the_wait(monkeypatch) -> None:
    monkeypatch.setattr(failures, "_left", [])
    release = threading.Event()
    ends_at = time.monotonic() + 0.05
    failures.leave_in_mpi("stuck-lane", lambda: not release.is_set())
    failures.leave_in_mpi("ending-lane", lambda: time.monotonic() < ends_at)
    start = time.monotonic()
    assert failures.left_in_mpi(0.3) == ["stuck-lane"]
    assert 0.25 <= time.monotonic() - start < 2.0
    release.set()
    assert failures.left_in_mpi(1.0) == []


def test_an_aborted_lane_under_ulfm_leaves_its_running_operation_to_the_exit(monkeypatch) -> None:
    """The exit must not finalize MPI under a lane's thread still in the call it was
    aborted in (only a lane whose thread runs an operation is recorded)."""
    monkeypatch.setattr(failures, "_left", [])
    monkeypatch.setattr(failures, "ENABLED", True)
    idle = Lane("idle-lane", inline=False)
    idle.abort(RuntimeError("aborted"))
    release, started = threading.Event(), threading.Event()
    busy = Lane("busy-lane", inline=False)
    busy.submit("create", lambda: (started.set(), release.wait(30)))
    assert started.wait(10)
    busy.abort(RuntimeError("aborted"))
    assert failures.left_in_mpi(0.1) == ["busy-lane"]
    release.set()
    assert failures.left_in_mpi(5.0) == []
