"""Start-up under ``mpirun``: torch's ``env://`` rendezvous answered from MPI.

Where ``RANK`` is not set but an MPI launcher's variables are (MPICH/hydra's
``PMI_RANK``, Open MPI's ``OMPI_COMM_WORLD_RANK``, PMIx's ``PMIX_RANK``), rank and size
are ``MPI.COMM_WORLD``'s, and the store torch requires is a
:class:`torch.distributed.TCPStore` served by rank 0 on a free port, whose host name and
port rank 0 broadcasts over MPI (no ``MASTER_ADDR``/``MASTER_PORT``). Where ``RANK`` is
set (torchrun, or the user's own variables), torch's own ``env://`` runs unchanged. Either
way, under an MPI launcher a ``RANK`` or ``WORLD_SIZE`` that is set must equal MPI's.
"""
from __future__ import annotations

import importlib
import os
import socket
from datetime import timedelta
from typing import Any, Iterator

import torch.distributed as dist

__all__ = ["mpi_rendezvous", "answer_joiners", "install_env_handler", "world"]

#: Environment variables that say a process was started by an MPI launcher.
_LAUNCHER_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MPI_LOCALRANKID")


def in_mpi_launch() -> bool:
    """Whether an MPI launcher started this process."""
    return any(var in os.environ for var in _LAUNCHER_RANK_VARS)


def world() -> Any:
    """The runtime's world (``MPI.COMM_WORLD`` until an elastic reconfiguration)."""
    from ...runtime import world as current  # noqa: PLC0415

    return current.comm()


def mpi_rendezvous(timeout: timedelta = timedelta(minutes=30)) -> tuple[Any, int, int]:
    """A shared store, rank and world size from MPI: rank 0 serves a ``TCPStore`` on a free
    port of its host and broadcasts host and port over ``MPI.COMM_WORLD`` (every rank
    calls it).

    Returns:
        ``(store, rank, world_size)``, as ``init_process_group(store=..., rank=...,
        world_size=...)`` takes them.
    """
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    store = None
    if rank == 0:
        store = dist.TCPStore("0.0.0.0", 0, size, True, timeout=timeout, wait_for_workers=False)
    host, port = comm.bcast((socket.gethostname(), store.port) if rank == 0 else None, root=0)
    if rank != 0:
        store = dist.TCPStore(host, port, size, False, timeout=timeout)
    _served[:] = [host, port]
    return store, rank, size


#: Where the store of the last :func:`mpi_rendezvous` is served (empty: there was none).
_served: list[Any] = []


def answer_joiners(comm: Any) -> None:
    """After the world grew (:mod:`mpicoll.elastic.grow`): the running ranks' half of the
    new processes' :func:`mpi_rendezvous`, whose broadcast over the grown world ``comm``
    tells them where rank 0 serves the store (collective over ``comm``).

    Raises:
        RuntimeError: the default group was not started by the MPI rendezvous (torchrun's
            or the user's own store, which the new processes cannot reach).
    """
    if not _served:
        raise RuntimeError(
            "mpicoll: the world grew, but the default process group was not started "
            "through mpicoll's MPI rendezvous (init_process_group('mpicoll') under mpirun "
            "without RANK set): the new processes cannot reach its store")
    comm.bcast(tuple(_served) if comm.Get_rank() == 0 else None, root=0)


_torch_env_handler = None


def _check_env_matches_mpi() -> None:
    """Under an MPI launcher: raise before the rendezvous (torch's would wait for ranks
    that never come; MPI's would silently run another world size than the one asked
    for) unless ``RANK`` and ``WORLD_SIZE``, where set, equal MPI's."""
    comm = world()
    env_rank, env_size = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if (env_rank not in (None, str(comm.Get_rank()))
            or env_size not in (None, str(comm.Get_size()))):
        raise RuntimeError(
            f"RANK={env_rank} WORLD_SIZE={env_size} in the environment, but MPI says rank "
            f"{comm.Get_rank()} of {comm.Get_size()}: unset RANK and WORLD_SIZE to take "
            f"both from MPI, or set them to MPI's")


def _env_handler(url: str, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
    """torch's ``env://``, answered from MPI where the process runs under an MPI launcher and
    ``RANK`` is not set."""
    if in_mpi_launch():
        _check_env_matches_mpi()
        if "RANK" not in os.environ:
            timeout = kwargs.get("timeout", timedelta(minutes=30))
            yield mpi_rendezvous(timeout)
            raise RuntimeError("unable to perform re-rendezvous using the MPI store")
    yield from _torch_env_handler(url, **kwargs)  # type: ignore[misc]


def install_env_handler() -> None:
    """Put the MPI fallback in front of torch's ``env://`` handler (idempotent)."""
    global _torch_env_handler
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    handlers = rendezvous._rendezvous_handlers
    if _torch_env_handler is None and handlers.get("env") is not _env_handler:
        _torch_env_handler = handlers["env"]
        handlers["env"] = _env_handler
