"""join(): uneven numbers of steps; autograd through the collectives."""
from __future__ import annotations

import pytest
import torch

import mpicoll.torch as hvd

pytestmark = pytest.mark.mpi


def test_join_uneven_steps_contribute_zeros():
    n = hvd.size()
    for rep in range(2):
        steps = hvd.rank() + 1 + rep                # rank r runs r + 1 + rep steps
        for step in range(steps):
            out = hvd.allreduce(torch.full((4,), float(step + 1)), name=f"join.{step}")
            active = [r for r in range(n) if r + 1 + rep > step]
            # joined ranks contribute zeros; the average divides by the full size
            assert torch.allclose(out, torch.full((4,), len(active) * (step + 1) / n))
        last = hvd.join()
        assert last == n - 1


def test_join_with_gradient_steps():
    # loss = sum(model(x)) with 4 rows of ones: the local gradient is 4 everywhere,
    # whatever the parameters, so the reduced gradient shows who contributed.
    n = hvd.size()
    model = torch.nn.Linear(3, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for step in range(hvd.rank() + 1):
        opt.zero_grad()
        model(torch.ones(4, 3)).sum().backward()
        opt.step()
        active = n - step                       # ranks r with r + 1 > step
        for p in model.parameters():
            assert torch.allclose(p.grad, torch.full_like(p, 4.0 * active / n))
    assert hvd.join() == n - 1


def test_allreduce_gradient():
    x = torch.full((3,), float(hvd.rank() + 1), requires_grad=True)
    y = hvd.allreduce(x, op=hvd.Sum)
    (y * torch.arange(3.0)).sum().backward()
    # d/dx_r sum_k w_k * sum_s x_s,k = allreduce_sum(w) = n * w
    assert torch.equal(x.grad, torch.arange(3.0) * hvd.size())
    z = torch.ones(2, requires_grad=True)
    hvd.allreduce(z).sum().backward()            # average: gradient averaged back
    assert torch.allclose(z.grad, torch.ones(2))


def test_allgather_gradient():
    rows = hvd.rank() + 1
    x = torch.ones(rows, 2, requires_grad=True)
    y = hvd.allgather(x)
    weights = torch.arange(float(y.shape[0])).unsqueeze(1).expand(-1, 2)
    (y * weights).sum().backward()
    start = sum(r + 1 for r in range(hvd.rank()))
    expect = weights[start:start + rows] * hvd.size()
    assert torch.equal(x.grad, expect)


def test_broadcast_gradient():
    root = hvd.size() - 1
    x = torch.full((2,), float(hvd.rank()), requires_grad=True)
    y = hvd.broadcast(x, root_rank=root)
    assert torch.equal(y.detach(), torch.full((2,), float(root)))
    (y * 3).sum().backward()
    expect = torch.full((2,), 3.0 * hvd.size()) if hvd.rank() == root else torch.zeros(2)
    assert torch.equal(x.grad, expect)
