"""A rank that dies inside the ParameterServer constructor (Open MPI with ULFM): every
survivor's constructor raises :class:`mpicoll.ProcessFailedError` naming it, within
:data:`BOUND_S` (issue 24's leftover: it used to be a raw ``MPI_ERR_PROC_FAILED``).

Each case is one ``mpirun --with-ft ulfm -n 3`` job of ps_ctor_kill_worker.py; rank 0 dies
at the start of a set-up step: the agreement of settings (separate servers) and the
initial values (co-located). Fails, not skips, where Open MPI's mpi4py cannot be had.
"""
from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest

import ompi_env
from mpi_launcher import run_command

WORKER = Path(__file__).with_name("ps_ctor_kill_worker.py")
BOUND_S = 2.0
JOB_TIMEOUT_S = 60
#: case -> (the constructor step rank 0 dies in, num_servers)
CASES = {"agree-1server": ("_agree", "1"), "values-colocated": ("_init_or_restore", "colocated")}


@pytest.fixture(scope="module")
def outputs() -> dict[str, tuple[int, str]]:
    python = ompi_env.ompi_python()

    def run(case: str) -> tuple[int, str]:
        step, servers = CASES[case]
        rc, out, _ = run_command(ompi_env.mpirun_command(python, 3, [str(WORKER), step,
                                                                     servers]),
                                 ompi_env.ompi_env(), JOB_TIMEOUT_S)
        return 124 if rc is None else rc, out

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {case: pool.submit(run, case) for case in CASES}
        return {case: f.result() for case, f in futures.items()}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", list(CASES))
def test_constructor_failure_is_process_failed_error(outputs, case) -> None:
    rc, out = outputs[case]
    results = {int(line.split()[1]): line.split()[2:] for line in out.splitlines()
               if line.startswith("RESULT ")}
    tail = "\n".join(out.splitlines()[-20:])
    assert rc != 124, f"{case}: the job hung\n{tail}"
    assert sorted(results) == [1, 2], f"{case}: survivors' lines {results}\n{tail}"
    for rank, fields in results.items():
        assert fields[0] == "pfe", f"{case}: rank {rank} got {fields}\n{tail}"
        assert float(fields[1]) < BOUND_S, f"{case}: rank {rank} took {fields[1]} s"
        assert fields[2] == "0", f"{case}: rank {rank} named {fields[2]}"
