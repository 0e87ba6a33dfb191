"""A rank that exits normally while others wait in mpicoll.torch: the others get an error
naming it within seconds, and the job ends (plain ``mpirun``, no abort, no verdict plugin)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from mpi_launcher import ROOT, mpirun_command

pytest.importorskip("torch")

#: Seconds a waiting rank may take to get its error once the other rank has left.
BOUND = 3.0

LEAVES = textwrap.dedent("""
    import sys, time
    import torch
    import mpicoll.torch as hvd
    torch.set_num_threads(1)
    hvd.init()
    if hvd.rank() == 1:
        time.sleep(1.0)          # rank 0 waits in the all-reduce by now
        sys.exit(0)              # a normal exit: atexit shuts mpicoll.torch down
    start = time.monotonic()
    try:
        hvd.allreduce(torch.ones(4), name="x")
    except hvd.CollectiveError as exc:
        print(f"waited {time.monotonic() - start:.2f} s: {exc}", flush=True)
        raise
""")

HOROVOD_STYLE_SUITE = textwrap.dedent("""
    import torch
    import mpicoll.torch as hvd

    hvd.init()

    def test_allreduce():
        assert hvd.rank() != 1, "rank 1's assertion fails"
        hvd.allreduce(torch.ones(4), name="x")     # rank 1 never comes
""")


def _run(args: list[str], timeout: float = 90) -> tuple[int, str, float]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    start = time.monotonic()
    proc = subprocess.run(mpirun_command(2) + args, capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT, check=False)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def test_rank_returning_from_its_script_fails_the_waiting_rank(tmp_path):
    script = tmp_path / "leaves.py"
    script.write_text(LEAVES)
    rc, out, _ = _run([sys.executable, str(script)])
    assert rc != 0, out
    match = re.search(r"waited ([\d.]+) s: allreduce 'x' failed: mpicoll\.torch has been shut "
                      r"down by rank 1 \(its process is exiting", out)
    assert match, out
    assert float(match.group(1)) < 1.0 + BOUND, out


def test_horovod_style_suite_with_a_failing_assertion_fails_fast(tmp_path):
    (tmp_path / "test_suite.py").write_text(HOROVOD_STYLE_SUITE)
    rc, out, secs = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--rootdir", str(tmp_path), str(tmp_path / "test_suite.py")])
    assert rc != 0, out
    assert "rank 1's assertion fails" in out, out
    assert "shut down by rank 1 (its process is exiting" in out, out
    assert out.count("1 failed") == 2, out          # both ranks report, neither hangs
    assert secs < 60, out


SHUTS_DOWN_FROM_A_THREAD = textwrap.dedent("""
    import threading, time
    import torch
    import mpicoll.torch as hvd
    hvd.init()
    if hvd.rank() == 0:
        def leave():
            time.sleep(0.3)
            start = time.monotonic()
            hvd.shutdown()
            print(f"SHUTDOWN {time.monotonic() - start:.2f}", flush=True)
        thread = threading.Thread(target=leave)
        thread.start()
        try:
            hvd.allreduce(torch.ones(3), name="late")
            print("RANK0 RETURNED", flush=True)
        except hvd.CollectiveError as exc:
            print(f"RANK0 FAILED {exc}", flush=True)
        thread.join()
    else:
        time.sleep(5.0)
        start = time.monotonic()
        try:
            hvd.allreduce(torch.ones(3), name="late")
            print("RANK1 RETURNED", flush=True)
        except hvd.CollectiveError as exc:
            print(f"RANK1 FAILED {time.monotonic() - start:.2f} {exc}", flush=True)
""")


def test_shutdown_from_another_thread_while_the_rank_waits(tmp_path):
    """Rank 0's main thread waits in an all-reduce rank 1 makes 5 s later; another thread
    of rank 0 shuts down at 0.3 s: the negotiation round already waiting for the idle rank
    held the shutdown back until rank 1 came (which then ran the all-reduce with a rank
    that had shut down). Now its notice goes out at once: shutdown returns, and both
    ranks' all-reduce fails, rank 1's naming rank 0."""
    script = tmp_path / "thread_shutdown.py"
    script.write_text(SHUTS_DOWN_FROM_A_THREAD)
    _, out, _ = _run([sys.executable, str(script)])
    took = re.search(r"SHUTDOWN ([\d.]+)", out)
    assert took and float(took.group(1)) < 1.5, out
    assert "RANK0 FAILED" in out and "RETURNED" not in out, out
    late = re.search(r"RANK1 FAILED ([\d.]+) .*shut down by rank 0", out)
    assert late and float(late.group(1)) < BOUND, out
