"""Entry point of one rank of an MPI test run: pytest on rank 0's stdout only.

Loads the per-test verdict plugin (tests/mpi_verdict.py). Ranks other than 0 send stdout to /dev/null (their failures reach rank 0's report through
the collective verdict in tests/conftest.py); stderr stays, so crashes remain visible.
"""
from __future__ import annotations

import os
import sys

from mpi4py import MPI

import pytest

if __name__ == "__main__":
    if MPI.COMM_WORLD.Get_rank() != 0:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    # hypothesis's plugin costs each rank 2 s of CPU at start; no MPI suite uses it
    code = pytest.main([*sys.argv[1:], "-p", "mpi_verdict", "-p", "no:hypothesispytest"])
    sys.stdout.flush()
    # pytest's exit code 5 ("no tests ran") is fine at world sizes a suite skips.
    code = 0 if code == 5 else int(code)
    # A rank that fails alone must not leave the others waiting: agree on the exit status.
    code = MPI.COMM_WORLD.allreduce(code, op=MPI.MAX)
    sys.exit(code)
