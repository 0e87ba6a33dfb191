"""mpicoll.ps.torch.PSOptimizer: a torch model trained through the PS equals a reference.

Runs only at world size 3 (torch's import is slow on the shared cores) and only when torch
is installed.
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

if MPI.COMM_WORLD.Get_size() != 3:
    pytest.skip("torch test runs at n=3 only", allow_module_level=True)
torch = pytest.importorskip("torch")

from mpicoll.ps.torch import PSOptimizer  # noqa: E402


def test_torch_model_bsp_sgd_matches_reference():
    comm = MPI.COMM_WORLD
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = PSOptimizer(model.named_parameters(), comm=comm, num_servers=1, optimizer="sgd",
                      lr=0.1, split_bytes=32, chunk_bytes=64)
    if opt.is_server:
        opt.serve()
        opt.free()
        comm.allgather(None)
        return
    rank = opt.ps.worker_index
    try:
        gen = torch.Generator().manual_seed(10 + rank)
        x, y = torch.randn(16, 5, generator=gen), torch.randn(16, 2, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads = {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}
        opt.step()
        after = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    finally:
        opt.close()
        opt.free()
    everyone = comm.allgather(grads)
    allg = [g for g in everyone if g is not None]
    for n, p0 in init.items():
        acc = allg[0][n].copy()
        for g in allg[1:]:
            acc += g[n]
        acc /= len(allg)
        want = p0.numpy() - 0.1 * acc
        np.testing.assert_array_equal(after[n], want, err_msg=n)
