"""The exit of a process under ULFM (:mod:`mpicoll.runtime.exit`).

It must never wait forever in ``MPI_Finalize`` (Open MPI 5.0.11's can wait forever for a
dead rank), must patch nothing, and must keep the program's exit status, except when a
rank of the world was lost while the process exited: then the job's status must say so.

- Singleton processes of this interpreter (no launcher, MPICH: ``failures.ENABLED`` is
  set by hand so that the exit handler acts as under ULFM): the status of ``sys.exit(3)``,
  a bare ``raise SystemExit(4)``, an uncaught exception and a normal end; a finalize
  that never returns (simulated) cut short, with the program's status after a failure it
  saw, else :data:`~mpicoll.runtime.exit.LOST_RANK_STATUS`; a failure first noticed at
  exit.
- Open MPI jobs with ULFM (exit_fault_worker.py, 4 ranks on 2 emulated nodes): the ranks
  of a node (rank 0's, or the other) SIGKILLed just before or while the others exit: the
  job ends within :data:`BOUND_S` of the kill with status ``LOST_RANK_STATUS`` (the code
  before the runtime ended these jobs with status 0, and now and then never ended them:
  its survivors waited in ``MPI_Finalize``); ranks that end later than the others by more
  than the bound on ``MPI_Finalize``, with nobody failing: status 0, every rank finalized.
"""
from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ompi_env
import ulfm_jobs

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("exit_fault_worker.py")

SCRIPT = """
import atexit, sys, time
atexit.register(lambda: print("EARLY HANDLER", flush=True))   # before mpicoll
import mpicoll
from mpicoll.runtime import exit, failures, world
atexit.register(lambda: print("LATE HANDLER", flush=True))
end, finalize, failure = sys.argv[1:4]
failures.ENABLED = True                    # the exit handler acts as under ULFM
if finalize == "hangs":
    exit.FINALIZE_WAIT_S = 0.5
    exit._mpi_finalize = lambda: time.sleep(3600)   # an MPI_Finalize that never returns
if failure == "seen":                      # the program saw a rank fail
    world.mark_failed(0, [1])
if failure == "at-exit":                   # noticed by an exit handler (at exit)
    atexit.register(world.mark_failed, 0, [1])
if end == "bare":
    raise SystemExit(4)
if end == "sys.exit":
    sys.exit(3)
if end == "uncaught":
    raise mpicoll.ProcessFailedError("a peer died", [1])
"""

#: (how the program ends, MPI_Finalize returns or hangs, a failure, the status expected)
CASES = [("sys.exit", "returns", "none", 3), ("bare", "returns", "none", 4),
         ("uncaught", "returns", "none", 1), ("end", "returns", "none", 0),
         ("end", "hangs", "seen", 0),
         ("end", "hangs", "none", 1), ("bare", "returns", "at-exit", 1)]


@pytest.fixture(scope="module")
def runs() -> dict:
    """Every case's (status, output), run a few at a time."""
    def run(case: tuple[str, str, str, int]) -> tuple[int, str]:
        proc = subprocess.run([sys.executable, "-c", SCRIPT, *case[:3]], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        return proc.returncode, proc.stdout + proc.stderr

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return dict(zip(CASES, pool.map(run, CASES)))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=["-".join(c[:3]) for c in CASES])
def test_the_exit_keeps_the_status_and_never_waits_forever(runs, case) -> None:
    end, finalize, failure, expected = case
    status, out = runs[case]
    assert status == expected, out
    assert "LATE HANDLER" in out, out
    if finalize == "hangs":
        assert "MPI_Finalize did not return within 0.5 s" in out, out
    if failure == "at-exit":
        assert "of the world failed while this process was exiting" in out, out
    if finalize == "returns" and failure != "at-exit":   # the interpreter's own end
        assert out.index("LATE HANDLER") < out.index("EARLY HANDLER"), out


#: Seconds from the kill to the end of the job (the jobs bound MPI_Finalize at 1 s).
BOUND_S = 10.0
JOB_TIMEOUT_S = 90
#: (ranks, when) -> whether they die (else they end late, and the job with status 0)
JOBS = {("0,1", "before"): True, ("2,3", "during"): True, ("1", "late"): False}


@pytest.fixture(scope="module")
def jobs() -> dict:
    """Every job's (status, output, seconds from the last kill to its end)."""
    python = ompi_env.ompi_python()

    def run(key: tuple[str, str]) -> tuple[int, str, float]:
        job = (WORKER, 4, list(key), {"MPICOLL_RANKS_PER_NODE": "2"}, JOB_TIMEOUT_S)
        rc, out, _ = ulfm_jobs.run_job(python, job)
        ended = time.time()
        kills = [float(f[0]) for f in ulfm_jobs.lines(out, "KILL")]
        return rc, out, ended - max(kills) if kills else float("nan")

    with concurrent.futures.ThreadPoolExecutor(ulfm_jobs.PARALLEL) as pool:
        return dict(zip(JOBS, pool.map(run, JOBS)))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("key", list(JOBS), ids=[f"{w}-{r}" for r, w in JOBS])
def test_a_rank_lost_while_the_others_exit_ends_the_job_with_a_failed_status(jobs, key):
    rc, out, after_kill = jobs[key]
    tail = "\n".join(out.splitlines()[-25:])
    if not JOBS[key]:
        assert rc == 0, f"status {rc} (124: the job hung)\n{tail}"
        assert "did not return" not in out, tail
        exited = sorted(f[0] for f in ulfm_jobs.lines(out, "EXITED"))
        assert exited == ["0", "1", "2", "3"], tail
        return
    assert rc not in (0, 124), f"status {rc} (124: the job hung)\n{tail}"  # 1 from mpicoll
    assert after_kill <= BOUND_S, f"the job ended {after_kill:.1f} s after the kill\n{tail}"
    assert "of the world failed while this process was exiting" in out, tail
