"""Process failures under Open MPI with ULFM: every survivor raises ProcessFailedError.

Each case is one ``mpirun --with-ft ulfm`` job of ulfm_worker.py (a process can die only
once per job): every rank loops over one collective and algorithm, one rank SIGKILLs
itself, and every survivor must raise :class:`mpicoll.ProcessFailedError` naming exactly
that rank within :data:`BOUND_S` of the kill. All jobs run first (two at a time), then
each case checks its own job's output.

The jobs need Open MPI's mpi4py: tests/ompi_env.py finds or builds the interpreter (the
cases fail, with the reason, when it cannot be built). CI runs the representative cases
(:data:`CASES`); ``ULFM_ALL_CASES=1`` runs every collective, algorithm and call.
"""
from __future__ import annotations

from pathlib import Path

import ompi_env
import pytest
import ulfm_jobs

WORKER = Path(__file__).with_name("ulfm_worker.py")

#: Seconds from the kill to the error on every survivor (issue 24's bound).
BOUND_S = 2.0
#: Seconds one job may take (a hang means a survivor never raised).
JOB_TIMEOUT_S = 30
OPEN_MPI_ABORT = ulfm_jobs.OPEN_MPI_ABORT

_ALGORITHMS = {
    "allreduce": ["hierarchical", "native", "rabenseifner", "recursive_doubling", "ring",
                  "shm", "tree"],
    "reduce_scatter": ["native", "recursive_halving", "ring"],
    "allgather": ["native", "recursive_doubling", "ring"],
    "broadcast": ["binomial", "native", "scatter_allgather"],
    "reduce": ["binomial", "native"],
}

#: Algorithms whose last rank is killed at n = 4 on every CI run: one per way of waiting
#: (point-to-point rounds, shared-memory windows, the node-aware composition, MPI's own
#: collective) and one hand-written algorithm of each other collective; the failure's
#: translation is the runtime's, the same for all (the others with ``ULFM_ALL_CASES=1``).
_REPRESENTATIVE = {"allreduce": ["hierarchical", "native", "ring", "shm", "tree"],
                   "reduce_scatter": ["recursive_halving"], "allgather": ["recursive_doubling"],
                   "broadcast": ["scatter_allgather"], "reduce": ["binomial"]}

Case = tuple[str, str, int, int]
"""(call, algorithm, world size, killed rank)"""

CASES: list[Case] = ulfm_jobs.selected(
    [(c, a, 4, 3) for c, algs in _REPRESENTATIVE.items() for a in algs]     # last rank
    # a middle rank: one hand-written algorithm per collective
    + [(c, [x for x in algs if x != "native"][-1], 3, 1) for c, algs in _ALGORITHMS.items()]
    + [("broadcast", "binomial", 4, 0), ("reduce", "binomial", 4, 0)]      # the root
    + [(f"Comm.{m}", "auto", 4, 2) for m in ("Allreduce", "Bcast")]
    + [("allreduce_init", a, 4, 3) for a in ("ring", "shm")]
    + [("compressed.allreduce", "auto", 4, 1)],
    # with ULFM_ALL_CASES=1: every algorithm, killed last and in the middle, every call
    [(c, a, 4, 3) for c, algs in _ALGORITHMS.items() for a in algs
     if a not in _REPRESENTATIVE[c]]
    + [(c, a, 3, 1) for c, algs in _ALGORITHMS.items()
       for a in algs if a != [x for x in algs if x != "native"][-1]]
    + [(f"Comm.{m}", "auto", 4, 2) for m in ("Reduce_scatter_block", "Allgather", "Reduce")]
    + [("allreduce_init", "hierarchical", 4, 3)]
    + [(f"compressed.{c}", "auto", 4, 1) for c in ("reduce_scatter", "allgather")])


def _case_id(case: Case) -> str:
    call, algorithm, n, victim = case
    return f"{call}-{algorithm}-n{n}-kill{victim}"


@pytest.fixture(scope="module")
def ompi_python() -> Path:
    """An interpreter whose mpi4py is Open MPI's, with ULFM (fails when there is none)."""
    return ompi_env.ompi_python()


@pytest.fixture(scope="module")
def job_outputs(ompi_python: Path) -> dict[tuple, tuple[int, str, float]]:
    """Every case's (exit status, output, seconds), the jobs run a few at a time."""
    # emulated nodes: hierarchical and shm cross them
    return ulfm_jobs.run_jobs(ompi_python, {
        case: (WORKER, case[2], [case[0], case[1], str(case[3])],
               {"MPICOLL_RANKS_PER_NODE": "2"}, JOB_TIMEOUT_S) for case in CASES})


def survivors_report(case: Case, out: str) -> list[str]:
    """What is wrong with a job's output (empty: every survivor raised
    ProcessFailedError naming exactly the killed rank within :data:`BOUND_S`)."""
    _, _, n, victim = case
    problems = []
    kill = [float(line.split()[1]) for line in out.splitlines() if line.startswith("KILL ")]
    if len(kill) != 1:
        return [f"no KILL line from rank {victim}"]
    results: dict[int, list[str]] = {}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            fields = line.split()
            results[int(fields[1])] = fields[2:]
    for rank in range(n):
        if rank == victim:
            continue
        got = results.get(rank)
        if got is None:
            problems.append(f"rank {rank}: no error (hung or died)")
        elif got[0] != "pfe":
            problems.append(f"rank {rank}: {' '.join(got)}")
        elif got[1] != str(victim):
            problems.append(f"rank {rank}: ProcessFailedError named {got[1]}, not {victim}")
        elif float(got[2]) - kill[0] > BOUND_S:
            problems.append(f"rank {rank}: raised {float(got[2]) - kill[0]:.2f} s after "
                            f"the kill (bound {BOUND_S} s)")
    return problems


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_killed_rank_is_an_error_on_every_survivor(job_outputs, case) -> None:
    rc, out, secs = job_outputs[case]
    problems = survivors_report(case, out)
    tail = "\n".join(out.splitlines()[-20:])
    print(f"{_case_id(case)}: job {secs:.1f} s\n{tail}")
    if OPEN_MPI_ABORT in out:  # twice in a row: Open MPI's limit, not mpicoll's
        pytest.xfail(f"Open MPI aborted the job twice ({OPEN_MPI_ABORT!r}): it ended, "
                     f"as without ULFM")
    assert not problems, f"{_case_id(case)} (rc={rc}, {secs:.1f} s): {problems}\n{tail}"
