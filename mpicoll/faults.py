"""Process failures as :class:`mpicoll.ProcessFailedError` on every survivor (ULFM).

Under an MPI with ULFM turned on (Open MPI launched with ``mpirun --with-ft ulfm``), a
peer that dies makes MPI calls that involve it fail with ``MPI_ERR_PROC_FAILED``. A
survivor waiting on *another survivor* would still wait forever, so on the first such
error this module revokes every communicator mpicoll holds for the user's communicator
(the communicator itself, the context's private point-to-point duplicate, the node and
leader communicators of its topology, which also carry the shared-memory windows, and the
stall inspector's duplicate): every pending and later call on them then fails with
``MPI_ERR_REVOKED``. Each rank then asks MPI which ranks failed (``MPI_Comm_get_failed``,
which works on a revoked communicator; a rank that only saw the revocation waits, within
:data:`FAILED_WAIT_S`, for its failure detector to report the dead rank) and raises
:class:`~mpicoll.ProcessFailedError` naming them, chained from the MPI error.

The public collectives are wrapped (:func:`guard`) only when :data:`ENABLED`: without
ULFM nothing is wrapped, so behaviour and cost are exactly those without this module.
"""
from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
import time
from typing import Any, Callable

from mpi4py import MPI

from .errors import ProcessFailedError

__all__ = ["available", "turned_on", "ENABLED", "is_process_failure", "failed_ranks",
           "revoke_all", "bind_contexts", "translate", "note_failure", "failure_seen",
           "exit_without_finalize", "finalize_or_exit", "as_process_failure", "keep_requests",
           "guard", "guard_call", "FAILED_WAIT_S", "FINALIZE_WAIT_S"]

#: Longest wait, in seconds, for the failure detector to name a failed rank after a
#: revocation (a rank woken by the revocation may not have noticed the death yet).
FAILED_WAIT_S = 1.0
#: The same wait after an MPI error of another class (a bad argument must not wait long).
OTHER_WAIT_S = 0.2

_FAILURE_CLASSES = tuple(getattr(MPI, name) for name in
                         ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
                         if hasattr(MPI, name))


def available() -> bool:
    """Whether the MPI library has working ULFM: Open MPI with the ``MPIX_Comm_*``
    functions (the MPICH wheel exports them but ends the job on a failure)."""
    if not (hasattr(MPI.Comm, "Revoke") and hasattr(MPI.Comm, "Get_failed")):
        return False
    try:
        return "Open MPI" in MPI.Get_library_version()
    except Exception:  # noqa: BLE001  (MPI not initialisable: no ULFM to use)
        return False


def turned_on() -> bool:
    """Whether fault tolerance is on for this job (``mpirun --with-ft ulfm`` sets
    ``OMPI_MCA_mpi_ft_enable=1``)."""
    for name in ("OMPI_MCA_mpi_ft_enable", "mpi_ft_enable"):
        value = os.environ.get(name, "").strip().lower()
        if value:
            return value in ("1", "true", "yes", "on", "enabled")
    return False


#: ULFM available and on: the public collectives translate process failures.
ENABLED = turned_on() and available()


def is_process_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is an MPI error that reports a failed process or a revocation
    (:func:`translate` also takes an MPI error of another class for one when a peer of
    the communicator is known to have failed)."""
    return _error_class(exc) in _FAILURE_CLASSES


def _error_class(exc: BaseException) -> int | None:
    if not isinstance(exc, MPI.Exception):
        return None
    try:
        return exc.Get_error_class()
    except Exception:  # noqa: BLE001
        return None


def _no_context(handle: int) -> Any:
    return None


def _plain_resolve(comm: Any) -> MPI.Comm:
    return MPI.COMM_WORLD if comm is None else comm


#: handle -> the mpicoll context of that communicator, or None; and ``comm=None`` -> the
#: current world. :mod:`mpicoll.context` installs both (:func:`bind_contexts`), so that
#: this module, which context and the stall inspector use, imports neither.
_context_of: Callable[[int], Any] = _no_context
_resolve: Callable[[Any], MPI.Comm] = _plain_resolve


def bind_contexts(context_of: Callable[[int], Any], resolve: Callable[[Any], MPI.Comm]) -> None:
    """Called by :mod:`mpicoll.context` at import: how to find a communicator's context
    (for :func:`revoke_all`) and what ``comm=None`` means (for :func:`translate`)."""
    global _context_of, _resolve
    _context_of, _resolve = context_of, resolve


def _held_comms(comm: MPI.Comm) -> list[MPI.Comm]:
    """Every communicator mpicoll holds for ``comm`` (``comm`` first), following the
    contexts of the communicators it holds (an inner algorithm on a leader communicator
    has a context, and a private duplicate, of its own)."""
    comms: list[MPI.Comm] = []
    seen: set[int] = set()
    todo = [comm]
    while todo:
        c = todo.pop()
        if not isinstance(c, MPI.Comm) or c == MPI.COMM_NULL or c.handle in seen:
            continue
        seen.add(c.handle)
        comms.append(c)
        ctx = _context_of(c.handle)
        if ctx is not None:
            todo += ctx.communicators()
    return comms


def revoke_all(comm: MPI.Comm) -> None:
    """Revoke ``comm`` and every communicator mpicoll holds for it (errors ignored)."""
    for c in _held_comms(comm):
        try:
            if c != MPI.COMM_NULL:
                c.Revoke()
        except Exception:  # noqa: BLE001  (already revoked, freed: nothing to wake)
            pass


def failed_ranks(comm: MPI.Comm, wait_s: float = FAILED_WAIT_S) -> list[int]:
    """The ranks of ``comm`` this process knows to have failed, waiting up to ``wait_s``
    seconds for at least one to be known."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            group = comm.Get_failed()
            try:
                size = group.Get_size()
                ranks = MPI.Group.Translate_ranks(group, list(range(size)),
                                                  comm.Get_group()) if size else []
            finally:
                group.Free()
        except Exception:  # noqa: BLE001
            ranks = []
        ranks = sorted(r for r in ranks if r is not None and r >= 0)
        if ranks or time.monotonic() >= deadline:
            return ranks
        try:  # drive MPI's progress engine: it delivers the failure notice
            MPI.COMM_SELF.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
        except Exception:  # noqa: BLE001
            pass
        time.sleep(0.001)


#: Requests left pending by failed collectives, never freed: Open MPI ends the job when a
#: freed send to a dead process fails ("Send error after request freed"), which is what
#: mpi4py's garbage collection of the failed call's request objects would do.
_orphans: list[MPI.Request] = []


def _keep_requests(exc: BaseException) -> None:
    """Keep every request object of the frames ``exc`` went through in :data:`_orphans`."""
    tb = exc.__traceback__
    while tb is not None:
        for value in list(tb.tb_frame.f_locals.values()):
            items = value if isinstance(value, (list, tuple)) else (value,)
            _orphans.extend(r for r in items if isinstance(r, MPI.Request))
        tb = tb.tb_next


def keep_requests(requests: list[Any]) -> None:
    """Never free ``requests`` (pending operations on a communicator with a dead peer):
    see :data:`_orphans`."""
    _orphans.extend(r for r in requests if isinstance(r, MPI.Request))


def as_process_failure(exc: BaseException, comm: Any) -> ProcessFailedError | None:
    """:func:`translate` as a value: the :class:`ProcessFailedError` that ``exc`` (raised
    by an MPI call on ``comm``) stands for, after revoking ``comm``'s communicators, or
    ``None`` when it is no process failure. For threads that report errors through
    futures (the torch engine) rather than raise them."""
    if not isinstance(exc, MPI.Exception):
        return exc if isinstance(exc, ProcessFailedError) else None
    try:
        translate(exc, comm)
    except ProcessFailedError as failure:
        return failure
    return None


#: Whether this process has seen a process failure (:func:`note_failure`).
failure_seen = False
_exit_code: list[Any] = []
#: Longest wait, in seconds, for ``MPI_Finalize`` at the exit of a process that has seen a
#: failure; past it the process ends without it (:func:`finalize_or_exit`).
FINALIZE_WAIT_S = 5.0
#: Whether the exit sequence of a process that saw a failure has taken over (then
#: :func:`exit_without_finalize`, called by an exit handler, returns).
_exit_taken_over = False


def note_failure() -> None:
    """Record that this process has seen a process failure: at exit it runs every exit
    handler, then finalizes MPI within :data:`FINALIZE_WAIT_S` or ends without
    ``MPI_Finalize`` (:func:`finalize_or_exit`); ``sys.exit``'s status is kept for that."""
    global failure_seen
    if failure_seen:
        return
    failure_seen = True
    plain_exit = sys.exit

    def recording_exit(status: Any = None) -> None:
        _exit_code[:] = [status]
        plain_exit(status)

    sys.exit = recording_exit
    _take_over_exit()


def _take_over_exit() -> None:
    """Run :func:`_exit_after_failure` when the interpreter starts its exit: after
    ``threading._shutdown`` (non-daemon threads joined), which the interpreter calls, by
    name, before any exit handler, whatever ends the program (its end, ``sys.exit``, a
    bare ``raise SystemExit(n)``, an uncaught exception)."""
    import threading  # noqa: PLC0415

    plain_shutdown = getattr(threading, "_shutdown", None)
    if plain_shutdown is None or getattr(threading, "_SHUTTING_DOWN", False):
        return   # exiting already: mpicoll's exit handler ends the process (as before)

    def shutdown() -> None:
        plain_shutdown()
        _exit_after_failure()

    threading._shutdown = shutdown  # type: ignore[attr-defined]


def _exit_after_failure() -> None:
    """Every exit handler (those registered before mpicoll was imported too, in the usual
    order), then :func:`finalize_or_exit`."""
    global _exit_taken_over
    import atexit  # noqa: PLC0415

    _exit_taken_over = True
    atexit._run_exitfuncs()   # runs and clears them: the interpreter finds none left
    finalize_or_exit()


def _known_status() -> Any:
    """The exit status as far as this process can tell: ``sys.exit``'s, 1 after an
    uncaught exception, else 0 (a bare ``raise SystemExit(n)`` is not seen here)."""
    status: Any = _exit_code[0] if _exit_code else 0
    if getattr(sys, "last_value", None) is not None and not _exit_code:
        status = 1
    if status is None:
        status = 0
    elif not isinstance(status, int):
        print(status, file=sys.stderr)
        status = 1
    return status


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


def finalize_or_exit(wait_s: float | None = None) -> None:
    """Finalize MPI, on a thread of its own, waiting for it at most ``wait_s`` seconds
    (:data:`FINALIZE_WAIT_S`; Open MPI 5.0.11's ``MPI_Finalize`` can wait forever for a
    dead rank, in about a third of the jobs whose rank 0 died). Then the interpreter exits
    as usual, with the program's own status, and mpi4py does not finalize again: where
    ``MPI_Finalize`` returned, and also where it is still waiting but MPI already says it
    is finalized (its exit handler then skips it; the process ends, that thread with it).
    Otherwise the process ends now, without ``MPI_Finalize``, with the status
    :func:`_known_status` gives."""
    import threading  # noqa: PLC0415

    if MPI.Is_finalized() or not MPI.Is_initialized():
        return
    _flush()
    finalizer = threading.Thread(target=_mpi_finalize, name="mpicoll-finalize", daemon=True)
    finalizer.start()
    finalizer.join(FINALIZE_WAIT_S if wait_s is None else wait_s)
    if not finalizer.is_alive() or _finalized():
        return
    print(f"mpicoll: MPI_Finalize did not return within {wait_s or FINALIZE_WAIT_S:g} s "
          f"after a process failure; ending without it", file=sys.stderr)
    _flush()
    os._exit(_known_status())


def _finalized() -> bool:
    try:
        return bool(MPI.Is_finalized())
    except Exception:  # noqa: BLE001
        return False


def exit_without_finalize() -> None:
    """End the process now, skipping ``MPI_Finalize`` (called by mpicoll's exit handler
    once a process failure was seen). Does nothing where the exit sequence of
    :func:`note_failure` has taken over (the usual case: every exit handler then runs,
    and MPI is finalized within a bound); this is the fallback for a failure first seen
    while the interpreter was already exiting. The status is the one ``sys.exit`` was
    given, 1 after an uncaught exception, else 0."""
    if _exit_taken_over:
        return
    status = _known_status()
    _flush()
    os._exit(status)


def translate(exc: BaseException, comm: Any) -> None:
    """Raise :class:`ProcessFailedError` from ``exc`` when it reports a process failure
    (after revoking every communicator of ``comm``); return otherwise (the caller
    re-raises ``exc``)."""
    error_class = _error_class(exc)
    if error_class is None:
        return
    try:
        user = _resolve(comm)
    except Exception:  # noqa: BLE001
        user = MPI.COMM_WORLD
    plain = user if type(user) is MPI.Intracomm else MPI.Intracomm(user)
    # another class (MPI_ERR_IN_STATUS from a wait on several requests; Open MPI's native
    # broadcast may say MPI_ERR_OTHER) is a failure only when a peer is known to have failed
    if error_class not in _FAILURE_CLASSES and not failed_ranks(plain, OTHER_WAIT_S):
        return
    note_failure()
    revoke_all(plain)
    _keep_requests(exc)
    ranks = failed_ranks(plain)
    raise ProcessFailedError(
        f"rank(s) {ranks} of the communicator failed during the collective (rank "
        f"{plain.Get_rank()} of {plain.Get_size()}); its communicators are revoked",
        ranks) from exc


def guard(fn: Callable[..., Any], comm_arg: str = "comm") -> Callable[..., Any]:
    """``fn`` with process failures translated (:func:`translate`); the communicator is
    the argument ``comm_arg`` (``"self"``: a :class:`mpicoll.Comm` method)."""
    params = list(inspect.signature(fn).parameters)
    index = params.index(comm_arg)

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except MPI.Exception as exc:
            comm = args[index] if len(args) > index else kwargs.get(comm_arg)
            translate(exc, comm)
            raise

    return guarded


def guard_call(call: Callable[[], Any], comm: Any) -> Callable[[], Any]:
    """``call`` (a planned collective of no arguments on ``comm``, such as what
    :func:`mpicoll.allreduce_init` returns) with process failures translated."""

    @functools.wraps(call)
    def guarded() -> Any:
        try:
            return call()
        except MPI.Exception as exc:
            translate(exc, comm)
            raise

    return guarded
