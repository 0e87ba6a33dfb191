"""Run a pytest suite under ``mpirun`` at several world sizes, each with a timeout.

Usage (from the repository root)::

    python tests/mpi_launcher.py -n 1,2,3,4,5,8 tests/mpi [extra pytest args]

Each world size runs ``mpirun -n N python tests/mpi_rank_entry.py <suite> --with-mpi``.
Rank 0 prints pytest's report; other ranks keep stderr only. A run past its timeout is
killed (the whole process group) and counts as a failure. Exit status 0 only if every
world size passed.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def mpirun_command(n: int, python: str = sys.executable,
                   mpirun_args: tuple[str, ...] = ()) -> list[str]:
    """The launcher prefix for ``n`` ranks: ``python``'s venv's mpirun (then ``mpirun_args``),
    oversubscribing if Open MPI."""
    exe = shutil.which("mpirun", path=str(Path(python).parent)) or shutil.which("mpirun")
    if exe is None:
        raise SystemExit("mpirun not found: install the 'mpich' extra (pip install .[mpich])")
    cmd = [exe, *mpirun_args, "-n", str(n)]
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    if "Open MPI" in version or "OpenRTE" in version:
        cmd.insert(1, "--oversubscribe")
    return cmd


def run_suite(n: int, suite: str, extra: list[str], timeout: float,
              env: dict[str, str] | None = None, python: str = sys.executable,
              mpirun_args: tuple[str, ...] = (),
              base_env: dict[str, str] | None = None) -> tuple[int, str, float]:
    """Run ``suite`` at ``n`` ranks with ``python`` (its venv's mpirun); return (exit
    status, output, seconds). The environment is ``base_env`` (default: this process's)
    updated with ``env``."""
    cmd = mpirun_command(n, python, mpirun_args) + [
        python, str(ROOT / "tests" / "mpi_rank_entry.py"), suite, "--with-mpi", "-q",
        "-p", "no:cacheprovider", *extra]
    full_env = dict(os.environ if base_env is None else base_env)
    full_env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    full_env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    full_env.update(env or {})
    rc, out, secs = run_command(cmd, full_env, timeout)
    if rc is None:
        out += f"\n*** TIMEOUT: {suite} at n={n} killed after {timeout:.0f} s ***\n"
        rc = 124
    return rc, out, secs


#: What a launcher prints when it failed before starting any rank, for a reason of its own
#: that a second start does not meet (Open MPI 5's PMIx server, under load: one job in
#: ~1,000 here, 0.2 s after the start). Such a launch is tried again, at most
#: :data:`LAUNCH_TRIES` times in all; any other failure counts.
LAUNCH_FAILURES = ("The PMIx server's listener thread failed to start",)
LAUNCH_TRIES = 3


def run_command(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int | None, str, float]:
    """Run ``cmd`` from the repository root in a session of its own, its output (stdout and
    stderr together) captured; past ``timeout`` seconds kill its whole process group. A
    launch that failed before any rank started (:data:`LAUNCH_FAILURES`) runs again.

    Returns:
        (exit status, or ``None`` when it was killed after the timeout; output; seconds).
    """
    for attempt in range(1, LAUNCH_TRIES + 1):
        rc, out, secs = _run_once(cmd, env, timeout)
        if rc == 0 or attempt == LAUNCH_TRIES or not any(m in out for m in LAUNCH_FAILURES):
            return rc, out, secs
        print(f"launcher failed before any rank started (try {attempt}); again: "
              f"{' '.join(cmd[:4])} ...", file=sys.stderr)
        time.sleep(0.5 * attempt)
    raise AssertionError("unreachable")


def _run_once(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int | None, str, float]:
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace",
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        states = describe_processes(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += f"\n*** still running at the timeout ({timeout:.0f} s) ***\n{states}"
        rc = None
    return rc, out, time.monotonic() - start


def describe_processes(pid: int) -> str:
    """What process ``pid`` and its descendants were doing: one line per thread with its
    state and kernel wait channel (what a hang is stuck in: a rank that never exited, a
    launcher that did not notice), for a timed-out job's failure message."""
    import psutil
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return "(gone)\n"
    lines = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            lines.append(f"pid {p.pid} ({p.status()}): {' '.join(p.cmdline())[:160]}")
        for task in sorted(Path(f"/proc/{p.pid}/task").glob("*")):
            with contextlib.suppress(OSError):
                stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
                lines.append(f"  thread {task.name} {stat[0]} in {(task / 'wchan').read_text()}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--sizes", default="1,2,3,4,5,8",
                        help="comma-separated world sizes (default 1,2,3,4,5,8)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per world size")
    parser.add_argument("suite", help="test directory or file")
    args, extra = parser.parse_known_args(argv)
    failed = []
    for n in [int(s) for s in args.sizes.split(",")]:
        rc, out, secs = run_suite(n, args.suite, extra, args.timeout)
        print(f"===== {args.suite} at n={n}: {'ok' if rc == 0 else f'FAILED (rc={rc})'} "
              f"in {secs:.1f} s =====")
        print(out, flush=True)
        if rc != 0:
            failed.append(n)
    print(f"world sizes failed: {failed}" if failed else "all world sizes passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
