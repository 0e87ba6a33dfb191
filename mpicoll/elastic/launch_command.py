"""The command line of one launch for the relaunching supervisor.

Launchers:

- ``mpiexec`` (the default outside Slurm): the running environment's, i.e. the one next to
  the Python running the supervisor (a venv's ``bin/``) or else the first on ``PATH``;
  ``--mpiexec`` names another. MPICH's hydra gets ``-n NP`` and, unless every host is this
  one, ``-hosts h1:s1,h2:s2``; Open MPI's ``mpirun`` gets ``-n NP``, ``--host h1:s1,...``
  and ``-x`` for the supervisor's variables (it does not forward the environment to
  remote hosts by itself).
- ``srun`` (the default inside a Slurm allocation): ``srun --nodelist=<alive nodes>
  --nodes=K --ntasks=NP --kill-on-bad-exit=1 --mpi=pmi2`` (PMI-2 is what the MPICH wheel
  speaks under Slurm; ``--srun-mpi`` changes it); ``--kill-on-bad-exit`` ends the step when one task dies, as hydra
  does, instead of leaving the others blocked in a collective.
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .launch_hosts import Host, is_local

__all__ = ["find_mpiexec", "mpiexec_flavour", "mpiexec_argv", "srun_argv", "place",
           "LaunchError"]


class LaunchError(RuntimeError):
    """No launcher can be found or run."""


def find_mpiexec(explicit: str | None = None) -> str:
    """The mpiexec to use: ``explicit`` (a path or a name on PATH), else the one beside
    this Python, else ``mpiexec`` on PATH.

    Raises:
        LaunchError: none found.
    """
    if explicit:
        found = shutil.which(explicit)
        if found is None:
            raise LaunchError(f"--mpiexec {explicit!r}: not found or not executable")
        return found
    beside = Path(sys.executable).parent / "mpiexec"
    if os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if found is None:
        raise LaunchError("no mpiexec next to this Python nor on PATH (give --mpiexec)")
    return found


@functools.lru_cache(maxsize=8)
def mpiexec_flavour(mpiexec: str) -> str:
    """``"openmpi"`` or ``"mpich"`` (hydra; also the guess for anything else), from
    ``mpiexec --version``."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                             timeout=30, check=False, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return "mpich"
    text = out.stdout + out.stderr
    return "openmpi" if ("Open MPI" in text or "OpenRTE" in text or "prte" in text.lower()) \
        else "mpich"


def place(hosts: list[Host], np: int) -> list[Host]:
    """The hosts the ``np`` ranks go to, filled in order (the first host's slots first),
    each with the slots it gets."""
    placed, left = [], np
    for host in hosts:
        if left <= 0:
            break
        take = min(host.slots, left)
        placed.append(Host(host.name, take))
        left -= take
    return placed


def mpiexec_argv(mpiexec: str, flavour: str, hosts: list[Host], np: int,
                 extra: list[str], command: list[str], exported: list[str]) -> list[str]:
    """``mpiexec`` command line for ``np`` ranks on ``hosts``."""
    used = place(hosts, np)
    argv = [mpiexec, "-n", str(np)]
    remote = not all(is_local(host.name) for host in used)
    names = ",".join(str(host) for host in used)
    if flavour == "openmpi":
        argv += ["--host", names if remote else f"localhost:{np}"]
        for name in exported:
            argv += ["-x", name]
    elif remote:
        argv += ["-hosts", names]
    return argv + list(extra) + list(command)


def srun_argv(hosts: list[Host], np: int, extra: list[str], command: list[str],
              mpi: str = "pmi2") -> list[str]:
    """``srun`` command line (a job step of the allocation) for ``np`` ranks on ``hosts``."""
    used = place(hosts, np)
    return (["srun", f"--nodelist={','.join(host.name for host in used)}",
             f"--nodes={len(used)}", f"--ntasks={np}", "--kill-on-bad-exit=1",
             f"--mpi={mpi}"] + list(extra) + list(command))
