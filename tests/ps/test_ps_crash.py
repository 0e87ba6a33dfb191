"""A crashed rank ends a parameter-server job within seconds (launched with -m mpi4py).

Each case launches its own small ``mpirun`` with a timeout: the job must end by itself,
with a non-zero status, well before the timeout (a hang would be killed at the timeout and
fail the test). Also runs the example end to end.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from mpi_launcher import mpirun_command, run_command

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "ps_train.py")
TIMEOUT = 90   # generous: the machine is shared; a hang is what this catches


def _launch(n: int, args: list[str]) -> tuple[int, str]:
    """Run the example at ``n`` ranks; fail on a hang, naming what each process was doing."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = mpirun_command(n) + [sys.executable, "-m", "mpi4py", EXAMPLE, *args]
    rc, out, _ = run_command(cmd, env, TIMEOUT)
    if rc is None:
        pytest.fail(f"job did not end within {TIMEOUT} s (a hang): {' '.join(cmd)}\n{out}")
    return rc, out


@pytest.mark.parametrize("mode", ["raise", "exit"])
@pytest.mark.parametrize("role,rank,servers,n", [("worker", 2, 1, 3), ("server", 1, 2, 4)])
def test_crash_aborts_whole_job(role, rank, servers, n, mode):
    rc, out = _launch(n, ["--servers", str(servers), "--steps", "1000000", "--crash-rank",
                          str(rank), "--crash-step", "3", "--crash-mode", mode])
    assert rc != 0, out
    assert "injected crash" in out, out


@pytest.mark.parametrize("servers", ["1", "colocated"])
def test_a_worker_leaving_without_close_ends_the_job(servers):
    """A clean exit (status 0) of a worker that never closed: the job ends, saying why
    (the servers and the other workers waited for it forever)."""
    rc, out = _launch(3, ["--servers", servers, "--steps", "1000000", "--crash-rank", "2",
                          "--crash-step", "3", "--crash-mode", "leave"])
    assert rc != 0, out
    assert "exits with its worker open (close() was not called)" in out, out


def test_crash_aborts_colocated_job():
    """Co-located: the others are inside a collective step with the dead rank."""
    rc, out = _launch(3, ["--servers", "colocated", "--steps", "1000000", "--crash-rank", "1",
                          "--crash-step", "3", "--crash-mode", "exit"])
    assert rc != 0, out
    assert "injected crash" in out, out


@pytest.mark.parametrize("args", [["--servers", "colocated"], ["--servers", "1"],
                                  ["--servers", "2", "--consistency", "ssp", "--staleness", "2"],
                                  ["--servers", "1", "--backup-workers", "1", "--slow-rank",
                                   "3", "--slow-factor", "3"]])
def test_example_trains(args):
    rc, out = _launch(4, [*args, "--steps", "150"])
    assert rc == 0, out
    final = [line for line in out.splitlines() if line.startswith("final:")]
    assert final, out
    acc = float(final[0].split("accuracy")[1].split()[0])
    assert acc > 0.6, final[0]   # a learning check, not a speed one: chance is 0.25


@pytest.mark.parametrize("mode", ["leave", "raise"])
def test_under_ulfm_a_rank_ending_the_job_ends_it(mode):
    """Open MPI with ULFM, where ``MPI_Abort`` ends the calling process only and the
    others polled on forever: a worker that exits without close() (or a server that
    raises, with a replica to fail over to) ends, and every other rank gets a
    ProcessFailedError within seconds (the runtime's abort revokes the world's
    communicators and ends the process by SIGKILL, a failure every peer sees)."""
    import ompi_env

    python = ompi_env.ompi_python()
    args = (["--servers", "1", "--crash-rank", "3", "--crash-mode", "leave"] if mode == "leave"
            else ["--servers", "2", "--replicas", "1", "--crash-rank", "0",
                  "--crash-mode", "raise"])
    cmd = ompi_env.mpirun_command(python, 4, [EXAMPLE, "--steps", "1000000",
                                              "--crash-step", "3", *args])
    rc, out, _ = run_command(cmd, ompi_env.ompi_env(), TIMEOUT)
    if rc is None:
        pytest.fail(f"job did not end within {TIMEOUT} s (a hang): {' '.join(cmd)}\n{out}")
    assert rc != 0 and "ProcessFailedError" in out, out
