"""One failing rank ends the whole run quickly, never a hang."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from mpi_launcher import LAUNCH_FAILURES, mpirun_command, run_command, run_suite

CRASH = textwrap.dedent("""
    import numpy as np, mpicoll
    from mpi4py import MPI
    if MPI.COMM_WORLD.rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    mpicoll.allreduce(np.ones(1000), algorithm="ring")   # the others wait for rank 1
""")


def test_uncaught_exception_aborts_all_ranks(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(CRASH)
    start = time.monotonic()
    proc = subprocess.run(mpirun_command(3) + [sys.executable, "-m", "mpi4py", str(script)],
                          capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "rank 1 fails on purpose" in proc.stdout + proc.stderr
    assert elapsed < 30, f"took {elapsed:.0f} s to abort"


FAILING_SUITE = textwrap.dedent("""
    import numpy as np, pytest, mpicoll
    from mpi4py import MPI
    pytestmark = pytest.mark.mpi

    def test_one_rank_fails():
        assert MPI.COMM_WORLD.rank != 1, "rank 1 disagrees"

    def test_next_collective_still_runs():
        mpicoll.allreduce(np.ones(10))
""")


def test_one_failing_rank_fails_the_suite_everywhere(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_fail.py").write_text(FAILING_SUITE)
    rc, out, secs = run_suite(3, str(suite), ["--rootdir", str(suite)], timeout=120)
    assert rc != 0, out
    assert "rank 1 disagrees" in out, out
    assert "1 failed, 1 passed" in out, out
    assert secs < 60


@pytest.mark.parametrize("n", [2])
def test_launcher_kills_a_hung_run(tmp_path, n):
    suite = tmp_path / "hang"
    suite.mkdir()
    (suite / "test_hang.py").write_text(textwrap.dedent("""
        import numpy as np, mpicoll
        from mpi4py import MPI
        def test_hang():
            if MPI.COMM_WORLD.rank == 0:
                mpicoll.allreduce(np.ones(4))   # rank 1 never joins
    """))
    rc, out, secs = run_suite(n, str(suite), ["--rootdir", str(suite), "-p", "no:timeout"],
                              timeout=10)
    assert rc != 0 and secs < 30


def test_launcher_retries_only_a_launch_that_never_started(tmp_path):
    """A launch that failed before any rank started (Open MPI's PMIx listener) runs again;
    a job that failed for itself is not rerun."""
    counter = tmp_path / "tries"
    script = ("import pathlib, sys; p = pathlib.Path(sys.argv[1]); "
              "n = int(p.read_text()) + 1 if p.exists() else 1; p.write_text(str(n)); "
              "print(sys.argv[2] if n < 3 else 'started'); sys.exit(213 if n < 3 else 0)")
    launch = [sys.executable, "-c", script, str(counter), LAUNCH_FAILURES[0]]
    rc, out, _ = run_command(launch, dict(os.environ), 30)
    assert (rc, out.strip(), counter.read_text()) == (0, "started", "3")

    counter.unlink()
    rc, out, _ = run_command(launch[:-1] + ["rank 1 raised"], dict(os.environ), 30)
    assert (rc, counter.read_text()) == (213, "1")


def test_an_abort_that_does_not_end_the_process_is_ended_by_the_kernel():
    """runtime.exit.abort: should MPI_Abort neither return nor end the process (here a
    stand-in that sleeps), the alarm it set ends the process with SIGALRM."""
    import signal

    script = textwrap.dedent("""
        import time, types
        from mpicoll.runtime import exit as runtime_exit
        runtime_exit.ABORT_WAIT_S = 1
        stuck = types.SimpleNamespace(Abort=lambda status: time.sleep(60))
        runtime_exit.MPI = types.SimpleNamespace(COMM_WORLD=stuck)
        runtime_exit.abort(3)
    """)
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,  # noqa: PLW1510
                         timeout=50)
    assert out.returncode == -signal.SIGALRM, (out.returncode, out.stderr)
    assert time.monotonic() - start < 20


def test_an_abort_that_returns_ends_the_process_with_its_status():
    """runtime.exit.abort: should MPI_Abort return (MPICH 5's does while another thread
    polls a request with MPI_Test: the caller went on until the launcher ended the job),
    the process ends there with the abort's status, nothing after it running."""
    script = textwrap.dedent("""
        import types
        from mpicoll.runtime import exit as runtime_exit
        returns = types.SimpleNamespace(Abort=lambda status: None)
        runtime_exit.MPI = types.SimpleNamespace(COMM_WORLD=returns)
        runtime_exit.abort(3)
        print("NOT ENDED", flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,  # noqa: PLW1510
                         timeout=50)
    assert (out.returncode, out.stdout) == (3, ""), (out.returncode, out.stdout, out.stderr)


def test_abort_waits_for_the_launcher_to_read_the_pipes():
    """runtime.exit.forwarded, which abort calls before MPI_Abort: it returns once the
    reader of stdout has read what was written (not before), and gives up after its bound
    when nobody reads."""
    script = textwrap.dedent("""
        import sys, time
        from mpicoll.runtime import exit as runtime_exit
        sys.stdout.write("x" * 5000)
        sys.stdout.flush()
        sys.stderr.write("written\\n")
        sys.stderr.flush()
        start = time.monotonic()
        done = runtime_exit.forwarded(float(sys.argv[1]))
        sys.stderr.write(f"{done} {time.monotonic() - start:.2f}\\n")
    """)
    # the reader reads stdout 1 s after the child says it has written (whatever its
    # import took): forwarded waits for it
    proc = subprocess.Popen([sys.executable, "-c", script, "20"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr.readline() == "written\n"
    time.sleep(1.0)
    assert proc.stdout.read() == "x" * 5000
    done, waited = proc.stderr.read().split()
    assert proc.wait(30) == 0
    assert done == "True" and 0.5 < float(waited) < 19, (done, waited)
    # nobody reads: it gives up after its bound
    proc = subprocess.Popen([sys.executable, "-c", script, "0.5"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    written, done, waited = proc.stderr.read().split()
    assert written == "written"
    assert done == "False" and 0.5 <= float(waited) < 5, (done, waited)
    assert proc.stdout.read() == "x" * 5000
    assert proc.wait(30) == 0
