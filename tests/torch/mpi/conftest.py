"""mpicoll.torch MPI suite: one ``hvd.init()`` per process, one torch thread per rank.

Without torch installed the whole suite is skipped (nothing is collected).
"""
from __future__ import annotations

import importlib.util

import pytest

collect_ignore_glob = [] if importlib.util.find_spec("torch") else ["test_*.py"]


@pytest.fixture(scope="session", autouse=True)
def hvd():
    import torch

    import mpicoll.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    yield hvd
    hvd.shutdown()
