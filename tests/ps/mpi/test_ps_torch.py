"""mpicoll.torch.ps_optimizer (PSOptimizer, and distributed_optimizer: the entry point of
mpicoll.torch.DistributedOptimizer(..., backend="ps")): models trained through the PS equal
references.

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

from mpicoll.torch.ps_optimizer import PSOptimizer  # noqa: E402


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


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _local_grads(model, index):
    gen = torch.Generator().manual_seed(10 + index)
    x, y = torch.randn(16, 5, generator=gen), torch.randn(16, 2, generator=gen)
    torch.nn.functional.mse_loss(model(x), y).backward()
    return {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}


@pytest.mark.parametrize("num_servers", ["colocated", 1])
def test_distributed_optimizer_backend_ps_runs_the_wrapped_optimizer(num_servers):
    """DistributedOptimizer(..., backend="ps"): the servers average the gradients
    (optimizer="sum"), every worker runs its own torch SGD on them."""
    import mpicoll.torch as hvd

    comm = MPI.COMM_WORLD
    model = _model()
    if comm.Get_rank() == 1:      # other initial weights: the first worker's are broadcast
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   backend="ps", comm=comm, num_servers=num_servers,
                                   split_bytes=32, chunk_bytes=64)
    assert isinstance(opt, torch.optim.SGD)
    grads = init = first = after = None
    if opt.is_server:
        opt.serve()
    else:
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        try:
            opt.zero_grad()
            grads = _local_grads(model, opt.ps.worker_index)
            opt.step()
            first = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
            opt.zero_grad()
            _local_grads(model, opt.ps.worker_index)
            opt.synchronize()
            with opt.skip_synchronize():
                opt.step()
            after = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
        finally:
            opt.close()
    opt.free()
    everyone = comm.allgather((init, after))
    workers = [e for e in everyone if e[0] is not None]
    for init_w, after_w in workers[1:]:   # identical start and result on every worker
        for n in init_w:
            np.testing.assert_array_equal(init_w[n].numpy(), workers[0][0][n].numpy())
            np.testing.assert_array_equal(after_w[n], workers[0][1][n])
    allg = [g for g in comm.allgather(grads) if g is not None]
    if first is not None:   # the first step equals torch SGD on the averaged gradients
        ref = _model()
        ref.load_state_dict(workers[0][0])
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)
        for n, p in ref.named_parameters():
            acc = allg[0][n].copy()
            for g in allg[1:]:
                acc += g[n]
            p.grad = torch.from_numpy(acc / len(allg))
        ref_opt.step()
        for n, p in ref.named_parameters():
            np.testing.assert_array_equal(first[n], p.detach().numpy(), err_msg=n)


def test_distributed_optimizer_server_side_adam_and_bad_names():
    from mpicoll.torch.ps_optimizer import distributed_optimizer

    comm = MPI.COMM_WORLD
    model = _model()
    base = torch.optim.SGD(model.parameters(), lr=123.0)    # not used: servers run adam
    with pytest.raises(ValueError, match="unique"):
        distributed_optimizer(base, named_parameters=[("a", p) for p in model.parameters()])
    opt = distributed_optimizer(base, named_parameters=model.named_parameters(), comm=comm,
                                num_servers="colocated", server_optimizer="adam",
                                lr=0.01)
    init = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    opt.zero_grad()
    grads = _local_grads(model, comm.Get_rank())
    opt.step()
    after = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    opt.close()
    opt.free()
    allg = comm.allgather(grads)
    for n, w in init.items():
        g = allg[0][n].copy()
        for a in allg[1:]:
            g += a[n]
        g /= len(allg)
        m, v = 0.1 * g, 0.001 * g * g
        want = w - 0.01 * (m / 0.1) / (np.sqrt(v / 0.001) + 1e-8)
        np.testing.assert_allclose(after[n], want, rtol=1e-5, atol=1e-6, err_msg=n)
