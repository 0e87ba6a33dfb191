"""Shared pytest configuration.

For tests marked ``mpi`` (run with ``--with-mpi`` under mpirun), every rank's outcome is
exchanged after the test body: if any rank failed, the test fails on every rank with each
failing rank's message, so ranks never drift apart into different tests (which would
hang), and one rank's failure is reported by rank 0.
"""
from __future__ import annotations

import pytest

collect_ignore_glob: list[str] = []


def _mpi_active(config: pytest.Config) -> bool:
    try:
        return bool(config.getoption("with_mpi"))
    except ValueError:
        return False


def pytest_configure(config: pytest.Config) -> None:
    # Hung MPI calls do not return to Python, so a signal-based timeout would never fire:
    # the thread method dumps stacks and exits the process, and mpirun ends the others.
    if _mpi_active(config):
        config.option.timeout_method = "thread"


def pytest_ignore_collect(collection_path, config):  # noqa: ANN001, ANN201
    """Outside mpirun, skip directories that hold only MPI suites (run by test_mpi_suites)."""
    if not _mpi_active(config) and (collection_path / "MPI_SUITE").exists():
        return True
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):  # noqa: ANN201
    if not _mpi_active(item.config) or item.get_closest_marker("mpi") is None:
        return (yield)
    from mpi4py import MPI  # noqa: PLC0415

    error: BaseException | None = None
    try:
        result = yield
    except BaseException as exc:  # noqa: BLE001  (re-raised below)
        error = exc
    failed = error is not None and not isinstance(error, pytest.skip.Exception)
    verdicts = MPI.COMM_WORLD.allgather(
        f"{type(error).__name__}: {str(error)[:3000]}" if failed else None)
    if error is not None:
        raise error
    bad = {r: v for r, v in enumerate(verdicts) if v}
    if bad:
        lines = "\n".join(f"  rank {r}: {v}" for r, v in bad.items())
        raise AssertionError(f"failed on other ranks:\n{lines}")
    return result
