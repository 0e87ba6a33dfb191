"""Shared pytest configuration.

Directories holding an ``MPI_SUITE`` marker file are MPI suites: the serial run skips
them, and tests/test_mpi_suites.py runs them under mpirun (with the per-test verdict
plugin tests/mpi_verdict.py on every rank).

Where torch is installed, the serial session starts by building the torch.distributed
backend's C++ extension (mpicoll/torch/distributed/extension.py; about a minute, once per
machine) in the background, so that no MPI suite's ranks spend their timeout compiling it.
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


_build: list[subprocess.Popen] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    """Start building the backend's C++ extension (serial run only), in a process of its
    own beside the first tests: a test that needs it before it is built waits on the
    build's lock (mpicoll/torch/distributed/extension.py); the MPI suites, which have
    timeouts, run last."""
    if _mpi_active(session.config) or importlib.util.find_spec("torch") is None:
        return
    _build.append(subprocess.Popen(
        [sys.executable, "-m", "mpicoll.torch.distributed.extension"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Report a build that failed (the backend's tests failed, saying why)."""
    for proc in _build:
        out, _ = proc.communicate(timeout=900)
        if proc.returncode != 0:
            print(f"\nmpicoll's torch.distributed extension was not built:\n{out[-3000:]}")


def pytest_ignore_collect(collection_path, config):  # noqa: ANN001, ANN201
    """Outside mpirun, skip directories that hold only MPI suites."""
    if not _mpi_active(config) and (collection_path / "MPI_SUITE").exists():
        return True
    return None


@pytest.fixture
def mpicoll_env(monkeypatch):
    """``mpicoll_env(NAME="value", ...)`` sets ``MPICOLL_*`` variables for one test;
    mpicoll's cache of them (:func:`mpicoll.config.refresh`) is cleared after setting them
    and again when the test ends."""
    from mpicoll import config

    def setenv(**values: str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)
        config.refresh()

    yield setenv
    monkeypatch.undo()
    config.refresh()
