"""Process failures: the one place mpicoll asks MPI about them (ULFM).

Under an MPI with ULFM turned on (Open MPI launched with ``mpirun --with-ft ulfm``), a
peer that dies makes MPI calls that involve it fail with ``MPI_ERR_PROC_FAILED``. A
survivor waiting on *another survivor* would still wait forever, so on the first such
error :func:`translate` marks the world failed (:mod:`mpicoll.runtime.world`) and revokes
every communicator the runtime holds for that world (:mod:`mpicoll.runtime.comms`: the
private duplicates, node and leader communicators, process sets, groups, the parameter
server's, the stall inspector's) and the communicator the call ran on: every pending and
later call on them fails with ``MPI_ERR_REVOKED``. Each rank then asks MPI which ranks
failed (``MPI_Comm_get_failed``, which works on a revoked communicator; a rank that only
saw the revocation waits, within :data:`FAILED_WAIT_S`, for its failure detector to report
the dead rank) and gets a :class:`~mpicoll.ProcessFailedError` naming them, chained from
the MPI error.

Clients never look at MPI error classes themselves: an error passes through
:func:`translate` where a call returns or a :class:`~mpicoll.runtime.progress.Work`
completes, and the client sees a :class:`~mpicoll.ProcessFailedError` or the error itself.
:func:`failed_by` classifies without side effects (the replicated parameter server, which
goes on after a failure, and acknowledges it with :func:`acknowledge`).

Without ULFM (:data:`ENABLED` false) nothing is translated and nothing is wrapped: a
failure ends the job, as MPI does.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import time
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..errors import CollectiveError, ProcessFailedError
from . import comms, world

__all__ = ["available", "turned_on", "ENABLED", "failed_by", "failed_ranks", "acknowledge",
           "revoke", "revoke_only", "revoked", "translate", "raise_translated", "keep_requests", "guard",
           "fail_world", "peer_failed", "start_agreement", "agreement_over", "FAILED_WAIT_S",
           "OTHER_WAIT_S", "PROC_FAILED", "leave_in_mpi", "left_in_mpi"]

#: Longest wait, in seconds, for the failure detector to name a failed rank after a
#: revocation (a rank woken by the revocation may not have noticed the death yet).
FAILED_WAIT_S = 1.0
#: The same wait after an MPI error of another class (a bad argument must not wait long).
OTHER_WAIT_S = 0.2

_FAILURE_CLASSES = tuple(getattr(MPI, name) for name in
                         ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
                         if hasattr(MPI, name))
_REVOKED = getattr(MPI, "ERR_REVOKED", None)
#: The error class of a process failure (for errors made up by a client that saw one).
PROC_FAILED = getattr(MPI, "ERR_PROC_FAILED", MPI.ERR_OTHER)


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


#: ULFM available and on: errors are translated, the public collectives guarded.
ENABLED = turned_on() and available()


def _error_class(exc: BaseException) -> int | None:
    if not isinstance(exc, MPI.Exception):
        return None
    try:
        return exc.Get_error_class()
    except Exception:  # noqa: BLE001
        return None


def _plain(comm: Any) -> MPI.Intracomm:
    return world.comm() if comm is None else comms.plain(comm)


def _progress() -> None:
    """Drive MPI's progress engine: it delivers failure notices."""
    with contextlib.suppress(Exception):
        MPI.COMM_SELF.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)


def failed_ranks(comm: Any, wait_s: float = FAILED_WAIT_S, progress: bool = False) -> list[int]:
    """The ranks of ``comm`` (``None``: the world) this process knows to have failed,
    waiting up to ``wait_s`` seconds for at least one to be known (``progress``: drive
    MPI's progress once first, so that a caller polling with ``wait_s=0`` learns of new
    failures). ``[]`` without ULFM."""
    if not ENABLED:
        return []
    comm = _plain(comm)
    deadline = time.monotonic() + wait_s
    if progress:
        _progress()
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
        _progress()
        time.sleep(0.001)


def start_agreement(comm: Any, flag: int) -> tuple[MPI.Request, Any]:
    """Begin ULFM's fault-tolerant agreement (``MPIX_Comm_iagree``: the bitwise AND of
    every live rank's ``flag``) over ``comm``, which may be revoked; every live rank of
    ``comm`` must begin one. Returns the request and the buffer that holds the agreed
    value once it completes (:func:`agreement_over`)."""
    buf = np.full(1, flag, np.intc)
    return _plain(comm).Iagree(buf), buf


def agreement_over(request: MPI.Request) -> bool:
    """Whether an agreement :func:`start_agreement` began has completed: every rank still
    alive joined it. A rank that failed before joining does not count (MPI then completes
    it with ``MPI_ERR_PROC_FAILED``, the same on every live rank: complete here)."""
    try:
        return bool(request.Test())
    except MPI.Exception as exc:
        if _error_class(exc) in _FAILURE_CLASSES:
            return True
        raise


def peer_failed(comm: Any) -> bool:
    """Whether MPI knows a rank of ``comm`` to have failed, now (never without ULFM)."""
    return bool(failed_ranks(comm, 0.0))


def _known_failed(comm: Any) -> bool:
    """:func:`peer_failed`, ``False`` for what is no communicator (a bad argument)."""
    try:
        return peer_failed(comm)
    except Exception:  # noqa: BLE001
        return False


def failed_by(exc: BaseException, comm: Any, wait_s: float = 0.0) -> list[int] | None:
    """Whether ``exc`` (raised by an MPI call on ``comm``) stands for a process failure:
    the failed ranks of ``comm`` (possibly ``[]`` for a bare revocation), else ``None``.
    No side effect. An MPI error of another class (``MPI_ERR_IN_STATUS`` from a wait on
    several requests; Open MPI's native broadcast may say ``MPI_ERR_OTHER``), and any
    other error when ``wait_s`` is given, count when a peer is known to have failed."""
    if not ENABLED:
        return None
    if isinstance(exc, ProcessFailedError):
        return list(exc.failed_ranks)
    error_class = _error_class(exc)
    if error_class in _FAILURE_CLASSES:
        return failed_ranks(comm, 0.0)
    if error_class is None and not wait_s:
        return None
    ranks = failed_ranks(comm, wait_s or OTHER_WAIT_S)
    return ranks or None


def revoked(comm: Any) -> bool:
    """Whether ``comm`` was revoked, by any rank (``MPI_Comm_is_revoked``)."""
    try:
        return bool(_plain(comm).Is_revoked())
    except Exception:  # noqa: BLE001  (freed, or no ULFM: not revoked)
        return False


def acknowledge(comm: Any) -> None:
    """Acknowledge the failures MPI reported on ``comm`` (``MPI_Comm_ack_failed``), so that
    ``MPI_ANY_SOURCE`` receives work again between live ranks (the replicated parameter
    server goes on this way, on the same communicator)."""
    with contextlib.suppress(MPI.Exception):  # revoked: the next call raises ERR_REVOKED anyway
        _plain(comm).Ack_failed()


def revoke(comm: Any) -> None:
    """Revoke ``comm`` and every communicator the runtime holds for its world (errors
    ignored: already revoked or freed, nothing to wake)."""
    gen = comms.world_of(comm) if comm is not None else world.generation()
    targets = [comm] if comm is not None else [world.comm()]
    for r in comms.of_world(gen):
        r.revoked = True
        targets.append(r.comm)
    if gen == world.generation():
        targets.append(world.comm())
    seen: set[int] = set()
    for c in targets:
        if not isinstance(c, MPI.Comm) or c == MPI.COMM_NULL or c.handle in seen:
            continue
        seen.add(c.handle)
        with contextlib.suppress(Exception):
            _plain(c).Revoke()


def revoke_only(comm: Any) -> None:
    """Revoke ``comm`` and every communicator the runtime made from it, and nothing else:
    a broken client (a timed-out or aborted lane) ends the MPI calls in flight on its own
    communicators, while its world stays healthy (it can be rebuilt from the world)."""
    records = comms.descendants(comm)
    rec = comms.record_of(comm)
    for r in records + ([rec] if rec is not None else []):
        r.revoked = True
    for c in [comm] + [r.comm for r in records]:
        with contextlib.suppress(Exception):  # (already revoked or freed)
            _plain(c).Revoke()


def _world_ranks(comm: Any, ranks: list[int], gen: int) -> list[int]:
    """``ranks`` of ``comm`` as ranks of world generation ``gen``'s communicator."""
    try:
        return sorted(r for r in world.world_ranks(_plain(comm), ranks, gen)
                      if r is not None and r >= 0)
    except Exception:  # noqa: BLE001  (freed or revoked: the ranks as given)
        return list(ranks)


def fail_world(comm: Any, ranks: list[int]) -> None:
    """The world of ``comm`` has failed: mark it (healthy -> failed, with ``ranks`` of
    ``comm`` as world ranks) and revoke every communicator of it, so that no survivor
    waits on another survivor."""
    gen = comms.world_of(comm)
    world.mark_failed(gen, _world_ranks(comm, ranks, gen) if ranks else [])
    revoke(comm)


def creation_failure(exc: BaseException, parent: Any, members: list[int],
                     created: Any = None) -> ProcessFailedError | None:
    """The :class:`~mpicoll.ProcessFailedError` of a communicator whose creation over the
    ranks ``members`` of ``parent`` (``[]``: all) failed with ``exc`` (a process failure,
    or any error while MPI knows a member to have failed), naming the failed members as
    ranks of the new communicator; ``created`` (a communicator made before the failure)
    is revoked, so members still creating wake. ``None``: no process failure (or no
    ULFM)."""
    members = members or list(range(parent.Get_size()))
    failure = failed_by(exc, parent) is not None
    dead = failed_ranks(parent, FAILED_WAIT_S if failure else OTHER_WAIT_S)
    ranks = [members.index(r) for r in dead if r in members]
    if not failure and not ranks:
        return None
    fail_world(parent if created is None or created == MPI.COMM_NULL else created, dead)
    error = ProcessFailedError(
        f"mpicoll: creating the communicator of ranks {members} failed: rank(s) {ranks} "
        f"of it failed (ranks {dead} of its parent)", ranks)
    error.__cause__ = exc
    return error


#: Requests left pending by failed collectives, never freed: Open MPI ends the job when a
#: freed send to a dead process fails ("Send error after request freed"), which is what
#: mpi4py's garbage collection of the failed call's request objects would do.
_orphans: list[MPI.Request] = []


def _keep_frames(exc: BaseException) -> None:
    tb = exc.__traceback__
    while tb is not None:
        for value in list(tb.tb_frame.f_locals.values()):
            keep_requests(value if isinstance(value, (list, tuple)) else [value])
        tb = tb.tb_next


def keep_requests(requests: list[Any]) -> None:
    """Never free ``requests`` (pending operations on a communicator with a dead peer)."""
    _orphans.extend(r for r in requests if isinstance(r, MPI.Request))


#: Operations left in an MPI call when their client was aborted (:func:`leave_in_mpi`):
#: (the client's name, whether the operation still runs).
_left: list[tuple[str, Callable[[], bool]]] = []


def leave_in_mpi(name: str, running: Callable[[], bool]) -> None:
    """Client ``name`` gave up on an operation its thread runs, in an MPI call that a
    revocation ends in most cases (Open MPI 5.0.11's ``MPI_Comm_create_group`` waits on
    for a dead member); ``running()`` says whether it still runs. :func:`left_in_mpi`
    names it at exit while it does."""
    _left[:] = [entry for entry in _left if entry[1]()] + [(name, running)]


def left_in_mpi(wait_s: float) -> list[str]:
    """The clients whose operations :func:`leave_in_mpi` recorded that still run after
    waiting at most ``wait_s`` seconds for them all to end (``MPI_Finalize`` must not run
    while a thread is in an MPI call: with one left in its progress loop it crashed)."""
    deadline = time.monotonic() + wait_s
    while True:
        names = [name for name, running in _left if running()]
        if not names or time.monotonic() >= deadline:
            return names
        time.sleep(0.01)


def translate(exc: BaseException, comm: Any, what: str = "the collective",
              wait_s: float = 0.0) -> BaseException:
    """The error a client reports for ``exc``, raised by an MPI call on ``comm`` (``None``:
    the world): a :class:`~mpicoll.ProcessFailedError` naming the failed ranks, chained
    from ``exc``, when it is a process failure (the world is then failed and revoked:
    :func:`fail_world`), else ``exc`` itself. ``wait_s``: also count any other error when
    MPI knows, within that many seconds, a peer of ``comm`` to have failed. Without ULFM,
    ``exc``.

    A revocation while no process of ``comm`` is known to have failed (within
    :data:`FAILED_WAIT_S`) comes from a peer whose client broke (a timeout or an abort
    there revokes that client's communicators only): a :class:`~mpicoll.CollectiveError`
    saying so, and the world stays healthy."""
    if isinstance(exc, ProcessFailedError):
        return exc
    ranks = failed_by(exc, comm, wait_s)
    if ranks is None:
        return exc
    plain = _plain(comm)
    if not ranks and _error_class(exc) == _REVOKED:
        ranks = failed_ranks(plain)
        if not ranks and not world.failed(comms.world_of(plain)):
            revoke_only(plain)
            error = CollectiveError(
                f"{what} ended: another rank revoked the communicator (a timeout or an "
                f"abort there broke it; no process failed); it cannot be used any more")
            error.__cause__ = exc
            error.peer_revoked = True    # (a client breaks its own lane on it)
            return error
    fail_world(plain, ranks)
    _keep_frames(exc)
    ranks = ranks or failed_ranks(plain)
    error = ProcessFailedError(
        f"rank(s) {ranks} of the communicator failed during {what} (rank "
        f"{plain.Get_rank()} of {plain.Get_size()}); its communicators are revoked", ranks)
    error.__cause__ = exc
    return error


comms.failure_of = lambda exc, parent: translate(exc, parent, "the creation of a communicator")
comms.dup_by_split = ENABLED


def raise_translated(exc: BaseException, comm: Any, what: str = "the collective",
                     wait_s: float = 0.0) -> None:
    """Raise :func:`translate`'s error when it is a process failure; return otherwise
    (the caller re-raises ``exc``)."""
    error = translate(exc, comm, what, wait_s)
    if error is not exc:
        raise error from exc


def guard(fn: Callable[..., Any], comm_arg: str = "comm", comm: Any = None) -> Callable[..., Any]:
    """``fn`` with process failures translated; the communicator is the argument
    ``comm_arg`` (``"self"``: a :class:`mpicoll.Comm` method), or ``comm`` where ``fn``
    takes no arguments (a planned collective of no arguments on ``comm``). An error that
    is not MPI's counts too while MPI knows a peer to have failed (mpi4py's unpickling of
    what a dead peer cut short), as in the groups' :mod:`mpicoll.torch.distributed`."""
    names = list(inspect.signature(fn).parameters)
    index = names.index(comm_arg) if names else None

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            on = (comm if index is None else
                  args[index] if len(args) > index else kwargs.get(comm_arg))
            if isinstance(exc, MPI.Exception):
                raise_translated(exc, on)
            elif _known_failed(on):
                raise_translated(exc, on, wait_s=OTHER_WAIT_S)
            raise

    return guarded
