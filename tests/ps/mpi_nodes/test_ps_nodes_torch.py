"""The torch front ends over a node-aware parameter server (local aggregation).

``DistributedOptimizer(..., backend="ps")`` and ``PSOptimizer``, co-located, with and
without local aggregation: every weight after each step is the same bits. Runs at world
size 4 (two emulated nodes of 2) and only when torch is installed.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

if MPI.COMM_WORLD.Get_size() != 4 or os.environ.get("MPICOLL_RANKS_PER_NODE") != "2":
    pytest.skip("runs at n=4 with MPICOLL_RANKS_PER_NODE=2", allow_module_level=True)
torch = pytest.importorskip("torch")

from mpicoll.torch.ps_optimizer import PSOptimizer, distributed_optimizer  # noqa: E402

COMM = MPI.COMM_WORLD


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _train(make, steps=3):
    model = _model()
    opt = make(model)
    assert opt.ps.local_aggregation is (make.la is True)
    seen = []
    gen = torch.Generator().manual_seed(100 + COMM.Get_rank())
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        seen.append([p.detach().numpy().copy() for p in model.parameters()])
    opt.close()
    opt.free()
    return seen


@pytest.mark.parametrize("front", ["distributed_optimizer", "PSOptimizer"])
def test_torch_front_ends_node_aware_equal_flat(front):
    runs = {}
    for la in (True, False):
        def make(model, la=la):
            if front == "PSOptimizer":
                return PSOptimizer(model.named_parameters(), comm=COMM,
                                   num_servers="colocated", optimizer="momentum", lr=0.1,
                                   local_aggregation=la)
            base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
            return distributed_optimizer(base, named_parameters=model.named_parameters(),
                                         comm=COMM, num_servers="colocated",
                                         local_aggregation=la)
        make.la = la
        runs[la] = _train(make)
    for a, b in zip(runs[True], runs[False]):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    # and every rank holds the same weights
    mine = np.concatenate([w.ravel() for w in runs[True][-1]])
    assert all(np.array_equal(mine, other) for other in COMM.allgather(mine))
