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
import os
import time
from typing import Any, Callable

from mpi4py import MPI

from .errors import ProcessFailedError

__all__ = ["available", "turned_on", "ENABLED", "is_process_failure", "failed_ranks",
           "revoke_all", "translate", "guard", "guard_call", "FAILED_WAIT_S"]

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


def _held_comms(comm: MPI.Comm) -> list[MPI.Comm]:
    """Every communicator mpicoll holds for ``comm`` (``comm`` first), following the
    contexts of the communicators it holds (an inner algorithm on a leader communicator
    has a context, and a private duplicate, of its own)."""
    from .context import _by_handle  # noqa: PLC0415  (no cycle at import)

    comms: list[MPI.Comm] = []
    seen: set[int] = set()
    todo = [comm]
    while todo:
        c = todo.pop()
        if not isinstance(c, MPI.Comm) or c == MPI.COMM_NULL or c.handle in seen:
            continue
        seen.add(c.handle)
        comms.append(c)
        ctx = _by_handle.get(c.handle)
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


def translate(exc: BaseException, comm: Any) -> None:
    """Raise :class:`ProcessFailedError` from ``exc`` when it reports a process failure
    (after revoking every communicator of ``comm``); return otherwise (the caller
    re-raises ``exc``)."""
    error_class = _error_class(exc)
    if error_class is None:
        return
    from .context import resolve_comm  # noqa: PLC0415

    try:
        user = resolve_comm(comm)
    except Exception:  # noqa: BLE001
        user = MPI.COMM_WORLD
    plain = user if type(user) is MPI.Intracomm else MPI.Intracomm(user)
    # another class (MPI_ERR_IN_STATUS from a wait on several requests; Open MPI's native
    # broadcast may say MPI_ERR_OTHER) is a failure only when a peer is known to have failed
    if error_class not in _FAILURE_CLASSES and not failed_ranks(plain, OTHER_WAIT_S):
        return
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
