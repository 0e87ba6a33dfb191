"""The process's exit: MPI is never waited for forever after a process failure.

Open MPI 5.0.11's ``MPI_Finalize`` can wait forever for a dead rank (in about a third of
the jobs whose rank 0 died, and in every job whose node died while the others exited).
Under ULFM (:data:`mpicoll.runtime.failures.ENABLED`) this module's exit handler,
registered with :mod:`atexit` when the runtime is imported (after ``mpi4py.MPI``, so it
runs before mpi4py's own finalization, and after the handlers registered later, mpicoll's
included), finalizes MPI on a thread of its own and waits for it at most
:data:`FINALIZE_WAIT_S` seconds:

- it returned, or MPI already says it is finalized (Open MPI does from the start of
  ``MPI_Finalize``): the interpreter ends as usual, with the program's own exit status,
  and mpi4py does not finalize again;
- otherwise the process ends now, without ``MPI_Finalize``, with status 1 when the
  program ended on an uncaught exception, else 0 (the launcher reports the failed rank).

Nothing in the interpreter is patched. Without ULFM a failure ends the job as MPI does,
and this handler does nothing. Exit handlers registered before mpicoll was imported run
after MPI is finalized (under ULFM only).
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import threading

from mpi4py import MPI

from . import failures, world

__all__ = ["FINALIZE_WAIT_S", "finalize_bounded", "failure_seen"]

#: Longest wait, in seconds, for ``MPI_Finalize`` at exit under ULFM.
FINALIZE_WAIT_S = 5.0


def failure_seen() -> bool:
    """Whether this process has seen a process failure (in any world generation)."""
    return any(world.failed(g) for g in range(world.generation() + 1))


def _status() -> int:
    return 1 if getattr(sys, "last_value", None) is not None else 0


def _flush() -> None:
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001  (closed: nothing to flush)
            pass


def _mpi_finalize() -> None:
    """``MPI_Finalize`` through ctypes, which lets other threads run meanwhile (mpi4py's
    ``MPI.Finalize`` holds the interpreter lock)."""
    import ctypes  # noqa: PLC0415

    ctypes.CDLL(MPI.__file__).MPI_Finalize()


def _finalized() -> bool:
    try:
        return bool(MPI.Is_finalized())
    except Exception:  # noqa: BLE001
        return False


def finalize_bounded(wait_s: float | None = None) -> None:
    """Finalize MPI, waiting at most ``wait_s`` seconds (:data:`FINALIZE_WAIT_S`); past
    that, end the process without it (see the module's docstring)."""
    if _finalized() or not MPI.Is_initialized():
        return
    limit = FINALIZE_WAIT_S if wait_s is None else wait_s
    _flush()
    finalizer = threading.Thread(target=_mpi_finalize, name="mpicoll-finalize", daemon=True)
    finalizer.start()
    finalizer.join(limit)
    if not finalizer.is_alive() or _finalized():
        return
    print(f"mpicoll: MPI_Finalize did not return within {limit:g} s; ending without it",
          file=sys.stderr)
    _flush()
    os._exit(_status())


@atexit.register
def _exit_under_ulfm() -> None:
    if failures.ENABLED:
        finalize_bounded()
