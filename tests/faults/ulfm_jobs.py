"""Running ``mpirun --with-ft ulfm`` jobs for the fault tests: a few at a time, each
with a timeout, each job's (exit status, output, seconds) kept by key.

A process can die only once per job, so every fault case is a job of its own; the jobs
of a test module run first (:func:`run_jobs`, from a module-scoped fixture), then each
case checks its own output.
"""
from __future__ import annotations

import concurrent.futures
import os
from pathlib import Path
from typing import Hashable, Sequence, TypeVar

import ompi_env
from mpi_launcher import run_command

#: Jobs run at once (2 cores here; more oversubscribes further and slows detection).
PARALLEL = 2

#: Open MPI 5.0.11 (ob1) sometimes aborts the whole job when a send that MPI had already
#: completed, and freed, fails after the peer died: the job ends, as without ULFM,
#: rather than raising. A job that ends so is run once more.
OPEN_MPI_ABORT = "Send error after request freed"
#: Open MPI 5.0.11 sometimes crashes (a segmentation fault in its failure handler,
#: ``ompi_comm_revoke_local``, during ``ompi_comm_activate`` of ``MPI_Comm_split``,
#: ``MPI_Comm_create_group`` or ``MPI_Comm_dup``) when a member dies while a communicator
#: is being made: a defect of Open MPI's, not of the program it runs.
OPEN_MPI_CREATE_CRASH = "ompi_comm_revoke_local"

Job = tuple[Path, int, list[str], dict[str, str], float]
"""(script, world size, arguments, extra environment, timeout in seconds)."""


#: Whether every case runs (``ULFM_ALL_CASES=1``), not only CI's representative ones.
ALL_CASES = os.environ.get("ULFM_ALL_CASES") == "1"

C = TypeVar("C")


def selected(cases: Sequence[C], more: Sequence[C]) -> list[C]:
    """``cases``, and ``more`` too with ``ULFM_ALL_CASES=1``."""
    return list(cases) + (list(more) if ALL_CASES else [])


def run_job(python: Path, job: Job) -> tuple[int, str, float]:
    """Run one job; (exit status (124 after the timeout), output, seconds)."""
    script, n, args, extra, timeout = job
    cmd = ompi_env.mpirun_command(python, n, [str(script), *args])
    rc, out, secs = run_command(cmd, ompi_env.ompi_env(**extra), timeout)
    return 124 if rc is None else rc, out, secs


def run_jobs(python: Path, jobs: dict[Hashable, Job],
             parallel: int = PARALLEL) -> dict[Hashable, tuple[int, str, float]]:
    """Run every job, ``parallel`` at a time; a job that Open MPI aborted
    (:data:`OPEN_MPI_ABORT`) runs once more."""
    with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
        futures = {key: pool.submit(run_job, python, job) for key, job in jobs.items()}
        outputs = {key: future.result() for key, future in futures.items()}
    for key, (_, out, _) in outputs.items():
        if OPEN_MPI_ABORT in out:
            outputs[key] = run_job(python, jobs[key])
    return outputs


def lines(out: str, tag: str) -> list[list[str]]:
    """The fields after ``tag`` of every output line that starts with it."""
    return [line.split()[1:] for line in out.splitlines() if line.startswith(tag + " ")]


def done(out: str) -> dict[int, list[str]]:
    """The fields after ``DONE <rank>`` of every such line, by rank."""
    return {int(fields[0]): fields[1:] for fields in lines(out, "DONE")}


def show(name: Hashable, result: tuple[int, str, float], last: int = 25) -> str:
    """Print job ``name``'s status, seconds and last ``last`` output lines; return those
    lines (for assertion messages)."""
    rc, out, secs = result
    tail = "\n".join(out.splitlines()[-last:])
    print(f"{name}: status {rc}, {secs:.1f} s\n{tail}")
    return tail
