"""Torch threads per rank when several ranks share a node's cores (torchrun's policy).

torch starts one intra-op thread per core it may use, in every process. With ``k`` ranks
on a node of ``c`` cores that is ``k * c`` threads, and their OpenMP spin-waits take the
cores from one another: on a 2-core machine at 2 ranks (2 threads each), a training step
without any communication ran at 0.08-0.10x its speed at one thread per rank, and DDP on
every backend with it (docs/results/ddp_threads.md). torch's CPU build starts one thread
per rank by itself where it recognises the launcher (``MPI_LOCALNRANKS``,
``OMPI_COMM_WORLD_LOCAL_SIZE``), and ``torchrun`` sets ``OMP_NUM_THREADS=1``; ``srun`` or a
wrapper that drops those variables gets neither. :func:`fit` does that job when
``mpicoll.torch.init()`` or ``init_process_group("mpicoll")`` runs:

- ``MPICOLL_TORCH_THREADS=auto`` (the default): if the user set neither
  ``OMP_NUM_THREADS`` nor torch's thread count (torch's count is still its default), and
  the ranks on this node times torch's threads exceed the cores this process may use,
  torch gets ``max(1, cores // ranks on the node)`` threads; rank 0 logs it once;
- ``keep``: leave torch's thread count alone;
- a number: that many threads.

The ranks on a node come from the launcher (``MPI_LOCALNRANKS``: MPICH's hydra;
``OMPI_COMM_WORLD_LOCAL_SIZE``: Open MPI; ``SLURM_NTASKS_PER_NODE`` when a single number),
else from the node communicator of :class:`mpicoll.topology.Topology` (not when
``MPICOLL_RANKS_PER_NODE`` emulates nodes).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Mapping

import torch

from .. import config

__all__ = ["fit", "planned_threads", "ranks_on_node"]

_LAUNCHER_LOCAL_SIZE = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE",
                        "SLURM_NTASKS_PER_NODE")
_done = False
#: torch's own thread count, read before the first fit (to tell it from a user's choice).
_DEFAULT = torch.get_num_threads()


def ranks_on_node(env: Mapping[str, str], comm: Any = None) -> int | None:
    """This node's ranks: from the launcher's environment, else ``comm``'s real node
    layout; ``None`` when neither tells."""
    for name in _LAUNCHER_LOCAL_SIZE:
        value = env.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    if comm is not None:
        from ..context import get_context  # noqa: PLC0415

        topology = get_context(comm).topology
        if not topology.emulated:
            return topology.node_comm.Get_size()
    return None


def planned_threads(setting: str, current: int, default: int, cores: int,
                    local: int | None, env: Mapping[str, str]) -> int | None:
    """The thread count :func:`fit` sets (``None``: leave torch's alone).

    Raises:
        ValueError: ``setting`` is neither ``auto``, ``keep`` nor a positive integer.
    """
    if setting == "keep":
        return None
    if setting != "auto":
        if not setting.isdigit() or int(setting) < 1:
            raise ValueError(f"MPICOLL_TORCH_THREADS={setting!r}: expected auto, keep or a "
                             f"positive integer")
        return int(setting)
    if ("OMP_NUM_THREADS" in env or current != default or local is None
            or local * current <= cores):
        return None
    return max(1, cores // local)


def fit(comm: Any = None) -> None:
    """Apply ``MPICOLL_TORCH_THREADS`` once per process (see the module docstring)."""
    global _done
    if _done:
        return
    _done = True
    setting = (config.env_str("MPICOLL_TORCH_THREADS") or "auto").strip().lower()
    cores = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    threads = planned_threads(setting, before, _DEFAULT, cores,
                              ranks_on_node(os.environ, comm) if setting == "auto" else None,
                              os.environ)
    if threads is None or threads == before:
        return
    torch.set_num_threads(threads)
    if comm is None or comm.Get_rank() == 0:
        logging.getLogger("mpicoll.torch").warning(
            "torch threads per rank %d -> %d: several ranks share this node's %d cores "
            "(as torchrun does; set OMP_NUM_THREADS, torch.set_num_threads or "
            "MPICOLL_TORCH_THREADS=keep to choose)", before, threads, cores)
