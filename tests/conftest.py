"""Shared pytest configuration.

Directories holding an ``MPI_SUITE`` marker file are MPI suites: the serial run skips
them, and tests/test_mpi_suites.py runs them under mpirun (with the per-test verdict
plugin tests/mpi_verdict.py on every rank).

Where torch is installed, the serial session first builds the torch.distributed backend's
C++ extension (mpicoll/torch/distributed/extension.py; about a minute, once per machine), so
that no MPI suite's ranks spend their timeout compiling it.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest


def _mpi_active(config: pytest.Config) -> bool:
    try:
        return bool(config.getoption("with_mpi"))
    except ValueError:
        return False


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the backend's C++ extension once, before any test (serial run only), in a
    process of its own; where it cannot be built, the backend's tests fail saying why."""
    if _mpi_active(session.config) or importlib.util.find_spec("torch") is None:
        return
    proc = subprocess.run([sys.executable, "-m", "mpicoll.torch.distributed.extension"],
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        print(f"\nmpicoll's torch.distributed extension is not built:\n{proc.stderr[-3000:]}")


def pytest_ignore_collect(collection_path, config):  # noqa: ANN001, ANN201
    """Outside mpirun, skip directories that hold only MPI suites."""
    if not _mpi_active(config) and (collection_path / "MPI_SUITE").exists():
        return True
    return None
