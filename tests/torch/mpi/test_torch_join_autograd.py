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


def test_allgather_gradient_is_averaged_over_ranks_like_horovod():
    # Horovod's backward: all-reduce the incoming gradient with Average, keep this rank's
    # rows. The incoming gradient differs per rank (scaled by rank + 1). Every collective
    # runs before the first assertion: gradients differ per rank, so a rank that failed
    # early would leave the others waiting in the next collective.
    n, me = hvd.size(), hvd.rank()
    rows = me + 1
    start = sum(r + 1 for r in range(me))
    mean_scale = sum(r + 1 for r in range(n)) / n
    got, expected = [], []
    for rep in range(2):
        x = torch.full((rows, 2), float(rep), requires_grad=True)
        y = hvd.allgather(x, name=f"ag.grad.{rep}")
        base = torch.arange(float(y.shape[0])).unsqueeze(1).expand(-1, 2) + rep
        (y * base * (me + 1)).sum().backward()
        got.append(x.grad)
        expected.append(base[start:start + rows] * mean_scale)
    for grad, expect in zip(got, expected):
        assert grad.shape == (rows, 2)
        assert torch.allclose(grad, expect, rtol=1e-6, atol=0)


def test_broadcast_gradient_is_averaged_onto_the_root_like_horovod():
    # Horovod's backward: all-reduce the incoming gradient with Average; zero off the root.
    # (Collectives first, assertions after: see the all-gather test.)
    n, me = hvd.size(), hvd.rank()
    mean_scale = sum(r + 1 for r in range(n)) / n
    got = []
    for root in sorted({0, n - 1}):
        x = torch.full((2,), float(me), requires_grad=True)
        y = hvd.broadcast(x, root_rank=root, name=f"bc.grad.{root}")
        (y * torch.tensor([3.0, 5.0]) * (me + 1)).sum().backward()
        got.append((root, y.detach(), x.grad))
    for root, value, grad in got:
        assert torch.equal(value, torch.full((2,), float(root)))
        expect = torch.tensor([3.0, 5.0]) * mean_scale if me == root else torch.zeros(2)
        assert torch.allclose(grad, expect, rtol=1e-6, atol=0)
