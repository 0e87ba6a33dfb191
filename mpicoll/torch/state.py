"""Process-wide state: ``init``/``shutdown`` and the layout queries.

``init()`` checks that MPI runs at ``THREAD_MULTIPLE`` (the engine thread calls MPI while
user threads may too), starts the :class:`~mpicoll.torch.engine.core.Engine` on a private
duplicate of ``comm`` and registers ``shutdown`` to run at exit. Calling it again while
initialized does nothing; after ``shutdown`` (this rank's or another's) it starts afresh.

``shutdown`` is Horovod's: not collective. The rank that calls it (or whose interpreter
exits: its script ended, it called ``sys.exit``, pytest returned) announces it in the next
negotiation round, and every other rank's pending and later operations fail with
``CollectiveError`` naming that rank, instead of waiting forever for it.
"""
from __future__ import annotations

import atexit
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

from mpi4py import MPI

from .. import timeline
from ..context import resolve_comm
from ..runtime import world as runtime_world
from . import process_sets as process_set_registry
from . import threads
from .engine.core import Engine
from .engine.settings import from_environment

__all__ = ["init", "shutdown", "abandon", "started", "started_after_groups", "is_initialized",
           "engine", "start_timeline", "stop_timeline",
           "size", "rank", "local_rank",
           "local_size", "cross_rank", "cross_size", "mpi_threads_supported", "mpi_enabled",
           "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
           "cuda_built", "rocm_built"]

_engine: Engine | None = None
_lock = threading.Lock()
_atexit_registered = False
#: Whether this process's first ``init`` came after its "mpicoll" default process group
#: (``None``: no ``init`` yet): a growth's new processes run the program from its top, so
#: the running ranks remake both on the grown world in that order
#: (:func:`mpicoll.torch.elastic.run`).
_after_groups: bool | None = None


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Start mpicoll.torch on ``comm`` (default: the runtime's world,
    :func:`mpicoll.runtime.world.comm`: ``MPI.COMM_WORLD`` unless elastic mode shrank or
    grew it); collective. An engine built for an earlier world generation is abandoned.

    Args:
        comm: an mpi4py communicator.
        process_sets: :class:`~mpicoll.torch.process_sets.ProcessSet` objects to register
            (in this order on every rank; duplicates are left unregistered).
    Raises:
        RuntimeError: MPI was initialized below ``THREAD_MULTIPLE``.
        ValueError: a malformed ``MPICOLL_*`` variable; bad process sets.
    """
    global _engine, _atexit_registered, _after_groups
    if _engine is not None and _engine.generation != runtime_world.generation():
        abandon("the world changed (mpicoll.elastic); mpicoll.torch started on the new one")
    with _lock:
        if _engine is not None and _engine.running():
            return
        if _engine is not None:
            _engine.join()                    # stopped (a shutdown): let it finish cleaning
        if isinstance(comm, (list, tuple)):
            raise ValueError("init(comm=[ranks]) is not supported; pass an mpi4py communicator")
        comm = resolve_comm(comm)
        provided = MPI.Query_thread()
        if provided < MPI.THREAD_MULTIPLE:
            raise RuntimeError(
                f"mpicoll.torch needs MPI initialized with THREAD_MULTIPLE (its engine thread "
                f"calls MPI while your threads may too) but MPI provides level {provided}; "
                f"do not set mpi4py.rc.thread_level / MPI4PY_RC_THREAD_LEVEL below 'multiple'")
        threads.fit(comm)
        engine = Engine(comm, from_environment())
        engine.on_peer_shutdown = _stop_process_sets
        engine.start()
        _engine = engine
        if _after_groups is None:
            dist = sys.modules.get("torch.distributed")
            _after_groups = bool(dist is not None and dist.is_initialized()
                                 and dist.get_backend() == "mpicoll")
        process_set_registry.attach(engine, comm)
        if not _atexit_registered:
            atexit.register(_shutdown_at_exit)
            _atexit_registered = True
    process_set_registry.register_all(process_sets)


def started_after_groups() -> bool:
    """Whether this process's first :func:`init` came after its "mpicoll" default process
    group (``dist.init_process_group("mpicoll")`` before ``hvd.init()``)."""
    return bool(_after_groups)


def _stop_process_sets(leaving: list[int]) -> None:
    """Another rank shut the adapter down: stop this rank's process-set engines too, so
    that their other ranks' operations fail instead of waiting for this one."""
    process_set_registry.detach(
        f"mpicoll.torch was shut down by rank{'s' if len(leaving) > 1 else ''} "
        f"{', '.join(map(str, leaving))}")


def _exit_reason() -> str:
    """Why this process is exiting, as far as the interpreter knows (for the other ranks)."""
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if exc is not None:
        return (f"its process is exiting after an uncaught {type(exc).__name__}: "
                f"{str(exc)[:200]}")
    return ("its process is exiting: its script ended, it called sys.exit(), or a test "
            "run (pytest) on it returned")


def _shutdown_at_exit() -> None:
    try:
        _stop(_exit_reason())
    except Exception as exc:  # noqa: BLE001  (nothing to raise to at exit)
        logging.getLogger("mpicoll.torch").warning("shutdown at exit failed: %s", exc)


def shutdown() -> None:
    """Stop mpicoll.torch on this rank and, as in Horovod, on every other one: not
    collective. The other ranks learn it in their next negotiation round (within about
    0.1 s, even while they compute), and their pending and later operations fail with
    ``CollectiveError`` naming this rank. A no-op if not initialized; it also runs at exit.
    """
    _stop("it called hvd.shutdown()")


def _stop(reason: str) -> None:
    global _engine
    with _lock:
        engine, _engine = _engine, None
    if engine is None or MPI.Is_finalized():
        return
    process_set_registry.detach(reason)
    engine.shutdown(reason)


def abandon(reason: str) -> None:
    """After a process failure: stop mpicoll.torch on this rank without a shutdown round
    and without freeing its communicators (their dead ranks would never answer); pending
    and later operations fail with ``reason`` until :func:`init` runs again (on the
    survivors' world: :mod:`mpicoll.torch.elastic`)."""
    global _engine
    with _lock:
        engine, _engine = _engine, None
    process_set_registry.detach(reason, "abandon")
    if engine is not None:
        engine.abandon(reason)


def started() -> bool:
    """Whether :func:`init` has run and no shutdown or abandon has followed (the engine
    may have stopped on a failure since: elastic mode starts it again)."""
    return _engine is not None


def is_initialized() -> bool:
    """Whether :func:`init` has run and mpicoll.torch has not been shut down since (by
    this rank or another)."""
    return _engine is not None and _engine.running()


def engine() -> Engine:
    """The engine of the operations in scope: a process set's
    (:func:`mpicoll.torch.process_sets.scoped`), else the global one.

    Raises:
        ValueError: not initialized.
    """
    return process_set_registry.current_engine() or _global()


def _global() -> Engine:
    if _engine is None:
        raise ValueError("mpicoll.torch has not been initialized; use hvd.init().")
    return _engine


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording a Chrome-trace timeline into ``file_path`` (Horovod's signature).

    Call it on every rank with the same path (each rank records its own events; rank 0
    merges them into ``file_path`` at :func:`stop_timeline`). Besides the core's events
    (every collective, on its communicator's track), each tensor gets a track with
    Horovod's activities: ``NEGOTIATE_<OP>``, ``<OP>``, ``MEMCPY_IN_FUSION_BUFFER``,
    ``MPI_<OP>``, ``MEMCPY_OUT_FUSION_BUFFER`` (see :mod:`mpicoll.torch.engine.trace`).

    Args:
        file_path: the merged Chrome-trace JSON file to write.
        mark_cycles: also record each negotiation round (``CYCLE``, track ``cycles``).
    Raises:
        ValueError: not initialized.
    """
    running = _global()
    timeline.start(file_path)
    running.mark_cycles = bool(mark_cycles)


def stop_timeline() -> None:
    """Stop recording; this rank writes its events, rank 0 merges every rank's into the
    file (waiting a few seconds for the others' parts; see :func:`mpicoll.timeline.stop`).

    Raises:
        ValueError: not initialized.
    """
    _global().mark_cycles = False
    timeline.stop()


def _layout(name: str, doc: str) -> Callable[[], int]:
    """A query named ``name`` that answers the global engine's attribute ``name``
    (Horovod's layout queries; ``ValueError`` if not initialized), documented by ``doc``."""
    def query() -> int:
        return getattr(_global(), name)
    query.__name__ = query.__qualname__ = name
    query.__doc__ = doc
    return query


size = _layout("size", "Number of ranks.")
rank = _layout("rank", "This process's rank.")
local_rank = _layout("local_rank", "This process's rank on its node.")
local_size = _layout("local_size", "Number of ranks on this node.")
cross_rank = _layout("cross_rank", "This node's index among the nodes (rank in the communicator "
                     "of equal local ranks).")
cross_size = _layout("cross_size", "Number of nodes (ranks with this local rank).")


def mpi_threads_supported() -> bool:
    """Whether MPI runs at ``THREAD_MULTIPLE``."""
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def _constant(name: str, value: bool, doc: str) -> Callable[[], bool]:
    """A query named ``name`` that always answers ``value`` (Horovod's build and
    controller queries), documented by ``doc``."""
    def query() -> bool:
        return value
    query.__name__ = query.__qualname__ = name
    query.__doc__ = doc
    return query


mpi_enabled = _constant("mpi_enabled", True, "Always true: mpicoll.torch runs over MPI.")
mpi_built = _constant("mpi_built", True, "Always true.")
gloo_enabled = _constant("gloo_enabled", False, "Always false (no Gloo controller).")
gloo_built = _constant("gloo_built", False, "Always false.")
nccl_built = _constant("nccl_built", False, "Always false (CPU tensors only).")
ddl_built = _constant("ddl_built", False, "Always false (no IBM DDL).")
ccl_built = _constant("ccl_built", False, "Always false (no oneCCL).")
cuda_built = _constant("cuda_built", False, "Always false (CPU tensors only).")
rocm_built = _constant("rocm_built", False, "Always false (CPU tensors only).")
