"""The "mpicoll" torch.distributed backend under mpirun: one ``init_process_group`` per
process, with no rendezvous argument (rank and size from MPI).

Without torch installed the whole suite is skipped (nothing is collected).
"""
from __future__ import annotations

import importlib.util

import pytest

collect_ignore_glob = [] if importlib.util.find_spec("torch") else ["test_*.py"]


@pytest.fixture(scope="session", autouse=True)
def process_group():
    import torch
    import torch.distributed as dist

    import mpicoll.torch  # noqa: F401  registers "mpicoll"

    torch.set_num_threads(1)
    dist.init_process_group("mpicoll")
    yield dist.group.WORLD
    dist.destroy_process_group()
