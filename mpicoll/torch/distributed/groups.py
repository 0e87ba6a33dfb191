"""Group helpers for "mpicoll" groups.

- :func:`backend_of`: the mpicoll backend (:class:`~.process_group.MPIProcessGroup`) of a
  torch process group, where its ``submit``, communicators and lanes are.
- :func:`monitored_barrier`: torch's ``dist.monitored_barrier`` refuses every backend
  but gloo; this one runs gloo's protocol on an mpicoll group.
- :func:`split_group`: torch's ``dist.split_group`` needs an accelerator and a C++
  backend that splits communicators; this one gives the same result (this rank's
  subgroup, or ``None``) through ``dist.new_group(..., use_local_synchronization=True)``,
  whose communicator only the subgroup's members create.
"""
from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["backend_of", "cpu_backend", "monitored_barrier", "split_group"]


def backend_of(group: Any = None, what: str = "backend_of") -> Any:
    """The mpicoll backend of ``group``.

    Args:
        group: a torch process group made with the "mpicoll" backend, or its backend
            itself (``None``: the default group).
        what: the caller's name, for the error message.
    Returns:
        Its :class:`~.process_group.MPIProcessGroup` (the backend torch registered for
        ``"cpu"`` and ``"cuda"``).
    Raises:
        ValueError: ``group`` is not an mpicoll group (or there is no default group).
    """
    # no mpicoll group exists before its module is imported: not importing it here keeps a
    # wrong group's error from loading (or building) the backend's C++ extension
    module = sys.modules.get(f"{__package__}.process_group")
    pg = dist.group.WORLD if group is None else group
    if module is not None and isinstance(pg, module.MPIProcessGroup):
        return pg
    backend = cpu_backend(pg)
    if module is None or not isinstance(backend, module.MPIProcessGroup):
        raise ValueError(f"{what} takes an mpicoll process group, not "
                         f"{type(pg).__name__} with backend {type(backend).__name__}")
    return backend


def cpu_backend(pg: Any) -> Any:
    """The backend torch registered for ``"cpu"`` in process group ``pg`` (``None``: none,
    or ``pg`` is not a process group)."""
    try:
        return pg._get_backend(torch.device("cpu"))
    except (AttributeError, RuntimeError):
        return None


def monitored_barrier(group: Any = None, timeout: timedelta | None = None,
                      wait_all_ranks: bool = False) -> None:
    """A barrier that names the ranks that do not arrive (gloo's semantics).

    Args:
        group: an mpicoll process group (``None``: the default group).
        timeout: how long rank 0 waits for the others (``None``: the group's timeout).
        wait_all_ranks: name every missing rank, not only the first.
    Raises:
        RuntimeError: on rank 0, ``"Rank 2 failed to pass monitoredBarrier in 1000 ms"``;
            on the others, that rank 0 did not release them in time.
    """
    if group == dist.GroupMember.NON_GROUP_MEMBER:   # new_group's value on non-members
        return
    backend_of(group, "monitored_barrier").monitored_barrier(timeout, wait_all_ranks)


def split_group(parent_pg: Any = None, split_ranks: list[list[int]] | None = None,
                timeout: timedelta | None = None, pg_options: Any = None,
                group_desc: str | None = None) -> Any:
    """``dist.split_group`` for mpicoll groups: every rank of ``parent_pg`` calls it with
    the same disjoint ``split_ranks`` (ranks of the parent group).

    Returns:
        The subgroup holding this rank, or ``None`` if no list names it.
    """
    if not split_ranks:
        raise ValueError("split_ranks cannot be None or empty")
    parent = dist.group.WORLD if parent_pg is None else parent_pg
    backend_of(parent, "split_group")
    me = dist.get_rank(parent)
    seen: set[int] = set()
    mine = None
    for ranks in split_ranks:
        if not ranks or len(ranks) != len(set(ranks)):
            raise ValueError(f"split group {ranks} is empty or repeats a rank")
        if seen & set(ranks):
            raise ValueError(f"split groups overlap: {sorted(seen & set(ranks))}")
        if not all(0 <= r < parent.size() for r in ranks):
            raise ValueError(f"split group {ranks} names ranks outside the parent group")
        seen |= set(ranks)
        if me in ranks:
            mine = sorted(ranks)
    if mine is None:
        return None
    global_ranks = [dist.get_global_rank(parent, r) for r in mine]
    return dist.new_group(global_ranks, timeout=timeout, pg_options=pg_options,
                          use_local_synchronization=True, group_desc=group_desc)
