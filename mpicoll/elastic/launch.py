"""The relaunching supervisor: elastic training for MPI libraries without ULFM (the MPICH
wheel, most site MPIs), in the manner of horovodrun's and torchrun's elastic modes.

::

    python -m mpicoll.elastic.launch --min-np 2 --max-np 4 \\
        [--host-discovery-script ./discover.sh] [--max-restarts 3] [--commit-dir D] \\
        -- python train.py ...

It discovers the hosts (:mod:`mpicoll.elastic.launch_hosts`: the script, else the Slurm
allocation, else this host with ``--max-np`` slots), launches the job on them with
``np = min(--max-np, slots)`` ranks (``-np`` for the first launch if given), and waits.

- Exit status 0: the supervisor exits 0.
- Anything else (under MPICH a dead rank ends the whole job): it discovers the hosts again,
  waits up to ``--elastic-timeout`` seconds for at least ``--min-np`` slots, and relaunches
  with the new ``np`` (restart counter + 1); the job resumes from the last commit on disk
  (:mod:`mpicoll.elastic.disk`; ``mpicoll.elastic.run`` does it by itself). After
  ``--max-restarts`` relaunches, or with fewer than ``--min-np`` slots, it prints why and
  exits 1.
- SIGINT/SIGTERM/SIGHUP to the supervisor: the job gets SIGTERM, then SIGKILL after
  5 s, and the supervisor exits 128 + the signal number; no process of the job is left.

Every launch has ``MPICOLL_ELASTIC_DIR`` (the commit directory: ``--commit-dir``, else a
temporary one removed at the end) and ``MPICOLL_ELASTIC_RESTART`` (0, 1, ...). The
supervisor appends one JSON line per event (``discovered``, ``launch``, ``started``
(with the launcher's pid, which is also the job's session id), ``exit``, ``stop``, and
last ``end`` with its exit status and why) with wall-clock times to
``<commit dir>/launch-events.jsonl``.

Exit statuses: 0 done; 1 gave up (restarts spent, too few slots, discovery failed);
2 bad usage (options, a command that cannot be found, no launcher); 128 + N a signal.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import disk
from .launch_command import (LaunchError, find_mpiexec, mpiexec_argv, mpiexec_flavour,
                             srun_argv)
from .launch_hosts import (DiscoveryError, Host, local_hosts, run_discovery_script,
                           slurm_hosts, total_slots)
from .launch_process import start_job, wait_job

__all__ = ["main", "parse_args", "Supervisor", "EVENTS_NAME", "GaveUp"]

log = logging.getLogger("mpicoll.elastic.launch")

#: The supervisor's event log, in the commit directory.
EVENTS_NAME = "launch-events.jsonl"
#: Seconds between two discoveries while waiting for enough slots.
DISCOVERY_INTERVAL_S = 1.0
#: Set by the re-exec (see :func:`_reexec_without_mpi`) to the user's MPI4PY_RC_INITIALIZE.
_REEXEC_MARK = "ELASTIC_LAUNCH_USER_MPI4PY_RC_INITIALIZE"
_UNSET = "<unset>"


class GaveUp(RuntimeError):
    """The supervisor stops without a finished job (exit status 1)."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The supervisor's options; the job's command follows ``--``.

    Raises:
        SystemExit(2): bad options (argparse's message).
    """
    parser = argparse.ArgumentParser(
        prog="python -m mpicoll.elastic.launch",
        description="Run an MPI job and relaunch it on the hosts still alive after a "
                    "failure, from the last commit on disk.",
        epilog="Example: python -m mpicoll.elastic.launch --min-np 2 --max-np 4 -- "
               "python train.py")
    parser.add_argument("--min-np", type=int, required=True,
                        help="fewest ranks to run with; below it the supervisor gives up")
    parser.add_argument("--max-np", type=int, required=True,
                        help="most ranks to run with")
    parser.add_argument("-np", "--np", dest="np", type=int, default=None,
                        help="ranks of the first launch (default: min(max-np, slots))")
    parser.add_argument("--host-discovery-script", default=None,
                        help="command printing the hosts alive, one 'hostname[:slots]' a "
                             "line (horovodrun's format)")
    parser.add_argument("--slots", type=int, default=1,
                        help="slots of a discovered host printed without a count (1)")
    parser.add_argument("--max-restarts", type=int, default=3,
                        help="relaunches allowed after failures (3)")
    parser.add_argument("--elastic-timeout", type=float, default=0.0,
                        help="seconds to wait for --min-np slots before giving up (0)")
    parser.add_argument("--commit-dir", default=None,
                        help="directory of the commits (default: a temporary one, removed "
                             "at the end)")
    parser.add_argument("--launcher", choices=("auto", "mpiexec", "srun"), default="auto",
                        help="auto: srun inside a Slurm allocation, else mpiexec")
    parser.add_argument("--srun-mpi", default="pmi2",
                        help="srun's --mpi plugin (pmi2: what the MPICH wheel speaks)")
    parser.add_argument("--mpiexec", default=None,
                        help="mpiexec to use (default: the one beside this Python, else "
                             "PATH's)")
    parser.add_argument("--launcher-args", default="",
                        help="extra arguments for mpiexec/srun, as one shell-quoted string "
                             "(with '=' when it starts with '-': --launcher-args=--oversubscribe)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log each step")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- then the job's command")
    args = parser.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        parser.error("no command to run: give it after --")
    if args.min_np < 1 or args.max_np < args.min_np:
        parser.error(f"need 1 <= --min-np <= --max-np, got --min-np {args.min_np} "
                     f"--max-np {args.max_np}")
    if args.np is not None and not args.min_np <= args.np <= args.max_np:
        parser.error(f"-np {args.np} is outside [--min-np, --max-np]")
    if args.max_restarts < 0 or args.slots < 1 or not 0 <= args.elastic_timeout < math.inf:
        parser.error("--max-restarts and --elastic-timeout must be >= 0 (a finite number of "
                     "seconds), --slots >= 1")
    try:
        shlex.split(args.launcher_args)
    except ValueError as exc:
        parser.error(f"--launcher-args {args.launcher_args!r}: {exc}")
    return args


@dataclass
class Supervisor:
    """The relaunch loop; :meth:`run` returns the exit status."""

    args: argparse.Namespace
    commit_dir: Path
    stop_signal: int | None = None
    launches: int = 0
    events: list[dict] = field(default_factory=list)

    # -- events ---------------------------------------------------------------------
    def event(self, kind: str, **fields: object) -> None:
        record = {"event": kind, "time": time.time(), **fields}
        self.events.append(record)
        log.info("%s", record)
        try:
            with open(self.commit_dir / EVENTS_NAME, "a") as file:
                file.write(json.dumps(record) + "\n")
        except OSError as exc:
            log.warning("cannot append to the event log: %s", exc)

    # -- discovery ------------------------------------------------------------------
    def discover(self) -> list[Host]:
        """The hosts alive now (see :mod:`mpicoll.elastic.launch_hosts`)."""
        a = self.args
        if a.host_discovery_script:
            return run_discovery_script(a.host_discovery_script, a.slots)
        if _in_slurm_allocation():
            return slurm_hosts()
        return local_hosts(a.max_np)

    def use_slurm(self) -> bool:
        """Whether launches are srun job steps (else mpiexec)."""
        if self.args.launcher == "srun":
            return True
        return self.args.launcher == "auto" and _in_slurm_allocation() \
            and shutil.which("srun") is not None

    def hosts_for_launch(self) -> tuple[list[Host], int]:
        """Discover until ``--min-np`` slots are there (``--elastic-timeout``); the hosts
        and the number of ranks to launch.

        Raises:
            GaveUp: too few slots at the deadline, or discovery failed.
        """
        a = self.args
        deadline = time.monotonic() + a.elastic_timeout
        while True:
            started = time.monotonic()
            try:
                hosts = self.discover()
            except DiscoveryError as exc:
                raise GaveUp(str(exc)) from exc
            slots = total_slots(hosts)
            self.event("discovered", hosts=[str(h) for h in hosts], slots=slots,
                       seconds=round(time.monotonic() - started, 4))
            if slots >= a.min_np:
                wanted = a.np if self.launches == 0 and a.np is not None else a.max_np
                return hosts, max(min(wanted, slots), a.min_np)
            if time.monotonic() >= deadline or self.stop_signal is not None:
                raise GaveUp(f"only {slots} slot(s) on {len(hosts)} host(s) alive "
                             f"({', '.join(map(str, hosts)) or 'none'}), fewer than "
                             f"--min-np {a.min_np}"
                             + (f" after waiting {a.elastic_timeout:g} s"
                                if a.elastic_timeout else ""))
            time.sleep(DISCOVERY_INTERVAL_S)

    # -- one launch -----------------------------------------------------------------
    def command_line(self, hosts: list[Host], np: int) -> list[str]:
        a = self.args
        extra = shlex.split(a.launcher_args)
        if self.use_slurm():
            return srun_argv(hosts, np, extra, a.command, mpi=a.srun_mpi)
        mpiexec = find_mpiexec(a.mpiexec)
        return mpiexec_argv(mpiexec, mpiexec_flavour(mpiexec), hosts, np, extra,
                            a.command, exported=[disk.ENV_DIR, disk.ENV_RESTART])

    def job_env(self, restart: int) -> dict[str, str]:
        env = dict(os.environ)
        if _REEXEC_MARK in env:  # give the jobs the user's own setting back
            users = env.pop(_REEXEC_MARK)
            if users == _UNSET:
                env.pop("MPI4PY_RC_INITIALIZE", None)
            else:
                env["MPI4PY_RC_INITIALIZE"] = users
        env[disk.ENV_DIR] = str(self.commit_dir)
        env[disk.ENV_RESTART] = str(restart)
        return env

    def run(self) -> int:
        """Launch, relaunch after failures; the supervisor's exit status."""
        a = self.args
        restart = 0
        while True:
            if self.stop_signal is not None:
                return 128 + self.stop_signal
            hosts, np = self.hosts_for_launch()
            argv = self.command_line(hosts, np)
            self.event("launch", restart=restart, np=np, hosts=[str(h) for h in hosts],
                       argv=argv)
            _say(f"launch {restart} with {np} rank(s) on {', '.join(map(str, hosts))}")
            try:
                proc = start_job(argv, self.job_env(restart))
            except OSError as exc:
                raise LaunchError(f"cannot start {argv[0]}: {exc}") from exc
            self.launches += 1
            self.event("started", restart=restart, pid=proc.pid)
            rc = wait_job(proc, lambda: self.stop_signal is not None)
            if rc is None:
                self.event("stop", signal=self.stop_signal)
                _say(f"stopped by signal {self.stop_signal}; the job was ended")
                return 128 + int(self.stop_signal or 0)
            self.event("exit", restart=restart, rc=rc)
            if rc == 0:
                return 0
            if self.stop_signal is not None:
                return 128 + self.stop_signal
            if restart >= a.max_restarts:
                raise GaveUp(f"the job failed (exit status {rc}) on launch {restart}; "
                             f"{a.max_restarts} restart(s) allowed (--max-restarts), "
                             f"giving up")
            restart += 1
            _say(f"the job failed (exit status {rc}); relaunching from the last commit in "
                 f"{self.commit_dir} (restart {restart} of at most {a.max_restarts})")


def _say(message: str) -> None:
    """Tell the user (stderr, at once)."""
    print(f"mpicoll.elastic.launch: {message}", file=sys.stderr, flush=True)


def _in_slurm_allocation() -> bool:
    return bool(os.environ.get("SLURM_JOB_NODELIST"))


def _check_command(command: list[str]) -> None:
    """A clear error now for a job command that cannot be found on this host."""
    program = command[0]
    if shutil.which(program) is None:
        raise LaunchError(f"the job's command {program!r} is not found or not executable")


def _check_commit_dir(commit_dir: Path) -> None:
    """A clear error now for a commit directory that cannot be made or written (else each
    launch's rank 0 fails its first commit)."""
    try:
        commit_dir.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=commit_dir).close()
    except OSError as exc:
        raise LaunchError(f"--commit-dir {commit_dir}: cannot write in it: {exc}") from exc


def _reexec_without_mpi() -> None:
    """``python -m mpicoll.elastic.launch`` imports mpicoll, which imports mpi4py and so
    initialises MPI (a singleton). The supervisor must not be an MPI process: start it
    again with ``MPI4PY_RC_INITIALIZE=0`` (once; the jobs get the variable removed), after
    finalizing the singleton (MPICH's left its shared-memory segment in /dev/shm)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or os.environ.get(_REEXEC_MARK) or not mpi.Is_initialized():
        return
    env = dict(os.environ)
    env[_REEXEC_MARK] = env.get("MPI4PY_RC_INITIALIZE", _UNSET)  # for the jobs
    env["MPI4PY_RC_INITIALIZE"] = "0"
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(Exception):     # (already finalized: nothing to leave)
        mpi.Finalize()
    os.execve(sys.executable, [sys.executable, "-m", "mpicoll.elastic.launch",
                               *sys.argv[1:]], env)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="mpicoll.elastic.launch: %(message)s")
    temporary = args.commit_dir is None
    commit_dir = Path(tempfile.mkdtemp(prefix="mpicoll-elastic-") if temporary
                      else args.commit_dir).resolve()
    try:
        _check_command(args.command)
        if args.launcher == "srun" and shutil.which("srun") is None:
            raise LaunchError("--launcher srun: srun is not on PATH")
        if args.launcher != "srun" and not (args.launcher == "auto"
                                            and _in_slurm_allocation()):
            find_mpiexec(args.mpiexec)
        _check_commit_dir(commit_dir)
    except LaunchError as exc:
        _say(f"error: {exc}")
        if temporary:
            shutil.rmtree(commit_dir, ignore_errors=True)
        return 2
    supervisor = Supervisor(args, commit_dir)

    def on_signal(signum: int, _frame: object) -> None:
        supervisor.stop_signal = signum

    previous = {s: signal.signal(s, on_signal)
                for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    status, reason = 1, "the supervisor failed"     # (an exception it does not handle)
    try:
        status = supervisor.run()
        reason = "done" if status == 0 else f"stopped by signal {status - 128}"
        return status
    except (GaveUp, LaunchError) as exc:
        if supervisor.stop_signal is not None:  # stopped while discovering
            status, reason = 128 + supervisor.stop_signal, \
                f"stopped by signal {supervisor.stop_signal}"
            _say(reason)
            return status
        _say(f"error: {exc}")
        reason = f"gave up: {exc}"
        return status
    finally:
        supervisor.event("end", status=status, reason=reason)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if temporary:
            shutil.rmtree(commit_dir, ignore_errors=True)


if __name__ == "__main__":
    _reexec_without_mpi()
    sys.exit(main())
