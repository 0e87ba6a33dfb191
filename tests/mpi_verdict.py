"""pytest plugin loaded on every rank of an MPI test run (by tests/mpi_rank_entry.py).

For tests marked ``mpi``, every rank's outcome is exchanged after the test body: if any
rank failed, the test fails on every rank with each failing rank's message, so ranks
never drift apart into different tests (which would hang), and rank 0's report shows a
failure that happened on another rank. Hung MPI calls do not return to Python, so the
timeout uses pytest-timeout's thread method (dump stacks, exit the process; mpirun then
ends the other ranks).
"""
from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.option.timeout_method = "thread"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):  # noqa: ANN201
    if item.get_closest_marker("mpi") is None:
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
    bad = {r: v for r, v in enumerate(verdicts) if v}
    if error is not None:
        raise error
    if bad:
        lines = "\n".join(f"  rank {r}: {v}" for r, v in bad.items())
        raise AssertionError(f"failed on other ranks:\n{lines}")
    return result
