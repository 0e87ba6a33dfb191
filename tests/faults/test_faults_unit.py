"""mpicoll.faults without ULFM (the MPICH venv, one process): the error class, the
detection, and that nothing is wrapped when ULFM is off."""
from __future__ import annotations

from mpi4py import MPI

import mpicoll
from mpicoll import collectives, compression, faults
from mpicoll.comm import Comm


def test_process_failed_error_is_a_collective_error_naming_the_ranks() -> None:
    exc = mpicoll.ProcessFailedError("rank 3 failed", [3, 1])
    assert isinstance(exc, mpicoll.CollectiveError)
    assert exc.failed_ranks == [1, 3]
    assert "ProcessFailedError" in mpicoll.__all__


def test_turned_on_reads_the_ft_variable(monkeypatch) -> None:
    for name in ("OMPI_MCA_mpi_ft_enable", "mpi_ft_enable"):
        monkeypatch.delenv(name, raising=False)
    assert not faults.turned_on()
    monkeypatch.setenv("OMPI_MCA_mpi_ft_enable", "1")
    assert faults.turned_on()
    monkeypatch.setenv("OMPI_MCA_mpi_ft_enable", "0")
    assert not faults.turned_on()


def test_ulfm_is_off_here_and_nothing_is_wrapped() -> None:
    if "Open MPI" not in MPI.Get_library_version():  # the MPICH wheel: no working ULFM
        assert not faults.available()
    if not faults.ENABLED:
        for fn in (mpicoll.allreduce, mpicoll.allreduce_init, mpicoll.reduce_scatter,
                   mpicoll.allgather, mpicoll.broadcast, mpicoll.reduce,
                   compression.allreduce, compression.allgather, compression.reduce_scatter,
                   Comm.Allreduce, Comm.Bcast):
            assert not hasattr(fn, "__wrapped__"), fn
        assert mpicoll.allreduce is collectives._PUBLIC["allreduce"]


def test_only_process_failures_are_translated() -> None:
    assert not faults.is_process_failure(ValueError("x"))
    assert not faults.is_process_failure(MPI.Exception(MPI.ERR_TRUNCATE))
    if hasattr(MPI, "ERR_PROC_FAILED"):
        assert faults.is_process_failure(MPI.Exception(MPI.ERR_PROC_FAILED))
        assert faults.is_process_failure(MPI.Exception(MPI.ERR_REVOKED))
    faults.translate(MPI.Exception(MPI.ERR_TRUNCATE), None)  # returns: not a failure
