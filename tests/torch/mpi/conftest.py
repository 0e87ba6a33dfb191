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



@pytest.fixture(params=["bulk", "per-tensor", "per-tensor-overlap"])
def mode(request, hvd):
    """DistributedOptimizer's two ways to reduce dense gradients (the same on every rank),
    and who runs the negotiation rounds (the waiting thread without overlap, the engine
    thread with); sparse gradients go their own way in each."""
    from mpicoll.torch.state import engine

    eng = engine()
    saved = eng.bulk_gradients, eng.overlap
    eng.bulk_gradients = request.param == "bulk"
    eng.overlap = request.param == "per-tensor-overlap"
    yield request.param
    eng.bulk_gradients, eng.overlap = saved
