"""Shared pytest configuration.

Directories holding an ``MPI_SUITE`` marker file are MPI suites: the serial run skips
them, and tests/test_mpi_suites.py runs them under mpirun (with the per-test verdict
plugin tests/mpi_verdict.py on every rank).
"""
from __future__ import annotations

import pytest


def _mpi_active(config: pytest.Config) -> bool:
    try:
        return bool(config.getoption("with_mpi"))
    except ValueError:
        return False


def pytest_ignore_collect(collection_path, config):  # noqa: ANN001, ANN201
    """Outside mpirun, skip directories that hold only MPI suites."""
    if not _mpi_active(config) and (collection_path / "MPI_SUITE").exists():
        return True
    return None
