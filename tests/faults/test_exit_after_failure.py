"""The exit of a process that has seen a process failure (mpicoll.faults.note_failure).

Such a process must not hang in ``MPI_Finalize`` (Open MPI 5.0.11's can wait forever for a
dead rank), yet it must exit like any program: every exit handler runs, also one
registered before mpicoll was imported, and the status is the program's own (a bare
``raise SystemExit(3)`` gives 3, an uncaught exception 1). Each case is one singleton
process of this interpreter (no launcher, no ULFM needed: the failure is recorded by
hand); the ``hang`` cases replace ``MPI_Finalize`` with a wait that never ends, which the
process must cut short. tests/faults/test_torch_dist_faults.py checks the same in a real
ULFM job.
"""
from __future__ import annotations

import concurrent.futures
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import atexit, sys, time
atexit.register(lambda: print("EARLY HANDLER", flush=True))   # before mpicoll
import mpicoll
from mpicoll import faults
atexit.register(lambda: print("LATE HANDLER", flush=True))
end, hang = sys.argv[1], sys.argv[2] == "hang"
if hang:
    faults.FINALIZE_WAIT_S = 0.5
    faults._mpi_finalize = lambda: time.sleep(3600)   # an MPI_Finalize that never returns
faults.note_failure()
if end == "bare":
    raise SystemExit(3)
if end == "sys.exit":
    sys.exit(4)
if end == "uncaught":
    raise mpicoll.ProcessFailedError("a peer died", [1])
"""

#: (how the program ends, whether MPI_Finalize hangs, the status expected)
CASES = [("bare", "finalize", 3), ("uncaught", "finalize", 1), ("sys.exit", "hang", 4),
         ("end", "hang", 0)]


@pytest.fixture(scope="module")
def runs() -> dict:
    """Every case's (status, output), run at once."""
    def run(case: tuple[str, str, int]) -> tuple[int, str]:
        proc = subprocess.run([sys.executable, "-c", SCRIPT, case[0], case[1]], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        return proc.returncode, proc.stdout + proc.stderr

    with concurrent.futures.ThreadPoolExecutor(len(CASES)) as pool:
        return dict(zip(CASES, pool.map(run, CASES)))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_exit_after_a_failure_runs_every_handler_with_the_programs_status(runs, case) -> None:
    status, out = runs[case]
    assert status == case[2], out
    assert "LATE HANDLER" in out and "EARLY HANDLER" in out, out
    assert out.index("LATE HANDLER") < out.index("EARLY HANDLER"), out   # the usual order
    if case[1] == "hang":
        assert "MPI_Finalize did not return within 0.5 s" in out, out
