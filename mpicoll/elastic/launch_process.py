"""One launch of the job for the relaunching supervisor: a process in its own session,
waited for while watching for a stop request, and ended with every process it started.

The launcher (mpiexec, srun) starts in a new session; its proxies and the ranks it forks
stay in that session (or below the launcher in the process tree), so :func:`kill_job`
finds them all through ``/proc`` (the session id, and descendants of the launcher) even
after the launcher itself is gone: a rank whose launcher died is not left behind.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

__all__ = ["start_job", "wait_job", "kill_job", "job_processes", "TERM_GRACE_S"]

#: Seconds between SIGTERM and SIGKILL when a job is stopped.
TERM_GRACE_S = 5.0
_POLL_S = 0.05


def _die_with_parent() -> None:
    """In the launcher's child before exec: SIGTERM it when the supervisor dies, even by
    SIGKILL (Linux ``PR_SET_PDEATHSIG``; hydra and srun end their ranks on SIGTERM)."""
    # not Linux (OSError, AttributeError): the signal handlers still end the job
    with contextlib.suppress(OSError, AttributeError):
        import ctypes  # noqa: PLC0415

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_job(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Start ``argv`` in a new session (stdin closed, output inherited), to be sent
    SIGTERM if the supervisor dies.

    Raises:
        OSError: the launcher cannot be executed.
    """
    return subprocess.Popen(argv, env=env, start_new_session=True,
                            stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, session id) of ``pid`` from /proc, ``None`` if gone or a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[3])


def job_processes(leader: int) -> set[int]:
    """Living processes of the job led by ``leader``: its session, and every descendant
    of the leader (even if it made a session of its own)."""
    stats = {int(entry): _stat(int(entry)) for entry in os.listdir("/proc") if entry.isdigit()}
    table = {pid: info for pid, info in stats.items() if info is not None}
    found = {pid for pid, (_, sid) in table.items() if sid == leader or pid == leader}
    # the descendants of what was found, until none is new
    while more := {pid for pid, (ppid, _) in table.items() if ppid in found} - found:
        found |= more
    found.discard(os.getpid())
    return found


def _signal_all(pids: set[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def kill_job(proc: subprocess.Popen, grace_s: float = TERM_GRACE_S) -> None:
    """End the job and everything it started: SIGTERM (the launcher forwards it to the
    ranks), then SIGKILL after ``grace_s`` to whatever is left. Returns once no process
    of the job is alive (bounded: a few seconds past ``grace_s``)."""
    leader = proc.pid
    _signal_all(job_processes(leader), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        proc.poll()
        if not job_processes(leader):
            break
        time.sleep(_POLL_S)
    for _ in range(3):   # processes forked meanwhile get the next round
        left = job_processes(leader)
        if not left:
            break
        _signal_all(left, signal.SIGKILL)
        time.sleep(_POLL_S)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)


def wait_job(proc: subprocess.Popen, stop_requested: Callable[[], bool]) -> int | None:
    """Wait for the job to end. Returns its exit status, or ``None`` if
    ``stop_requested()`` became true first (the job is then killed). Processes of the job
    still alive after the launcher ended (ranks a launcher left behind) are killed."""
    while True:
        if stop_requested():
            kill_job(proc)
            return None
        try:
            rc = proc.wait(timeout=_POLL_S * 2)
        except subprocess.TimeoutExpired:
            continue
        if job_processes(proc.pid):
            kill_job(proc, grace_s=1.0)
        return rc
