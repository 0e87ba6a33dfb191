"""hvd.SyncBatchNorm (issue 10): every rank holds a different-size slice (one of them
empty from 3 ranks on) of one global batch; outputs, input gradients, parameter gradients
(all-reduced with Sum) and running statistics must equal single-process torch.nn.BatchNorm
on the whole batch, in float64, over two training steps and one eval step.

Each test runs all its collectives before its first assertion.
"""
from __future__ import annotations

import pytest
import torch

import mpicoll.torch as hvd

pytestmark = pytest.mark.mpi

C = 3
TOL = {"rtol": 1e-10, "atol": 1e-10}


def rows(rank: int) -> int:
    """This rank's batch size: 3, 2, 0, 4 (rank 2 has none)."""
    return (3, 2, 0, 4)[rank % 4]


def global_batch(size: int, trailing: tuple, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    total = sum(rows(r) for r in range(size))
    return torch.randn((total, C, *trailing), generator=gen, dtype=torch.float64) * 2 + 1


def my_slice(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    start = sum(rows(r) for r in range(rank))
    return tensor[start:start + rows(rank)]


CASES = [  # (reference class, trailing dims, keyword arguments)
    (torch.nn.BatchNorm1d, (), {}),
    (torch.nn.BatchNorm1d, (5,), {"momentum": None}),
    (torch.nn.BatchNorm2d, (2, 3), {"affine": False}),
    (torch.nn.BatchNorm3d, (1, 2, 2), {"eps": 1e-3, "track_running_stats": False}),
]


def test_sync_batch_norm_matches_batch_norm_on_the_global_batch():
    n, me = hvd.size(), hvd.rank()
    records = []
    for case, (cls, trailing, kwargs) in enumerate(CASES):
        torch.manual_seed(case)
        reference = cls(C, **kwargs).double()
        if reference.affine:
            with torch.no_grad():
                reference.weight.uniform_(0.5, 1.5)
                reference.bias.uniform_(-0.5, 0.5)
        sync = hvd.SyncBatchNorm(C, **kwargs).double()
        sync.load_state_dict(reference.state_dict())
        for step in range(3):
            train = step < 2
            reference.train(train)
            sync.train(train)
            x_all = global_batch(n, trailing, step).requires_grad_()
            weights = global_batch(n, trailing, 50 + step)   # d loss / d output
            ref_out = reference(x_all)
            (ref_out * weights).sum().backward()
            x = my_slice(x_all.detach(), me).clone().requires_grad_()
            out = sync(x)
            (out * my_slice(weights, me)).sum().backward()
            grads = [hvd.allreduce(p.grad, op=hvd.Sum, name=f"sbn.{case}.{step}.{i}")
                     for i, p in enumerate(sync.parameters())]
            records.append((f"case {case} step {step}", out.detach(), my_slice(ref_out, me),
                            x.grad, my_slice(x_all.grad, me), grads,
                            [p.grad for p in reference.parameters()],
                            {k: v.clone() for k, v in sync.state_dict().items()},
                            {k: v.clone() for k, v in reference.state_dict().items()}))
            for module in (reference, sync):
                module.zero_grad()
    for label, out, ref_out, gx, ref_gx, grads, ref_grads, state, ref_state in records:
        torch.testing.assert_close(out, ref_out.detach(), **TOL, msg=f"{label}: output")
        torch.testing.assert_close(gx, ref_gx, **TOL, msg=f"{label}: input gradient")
        assert len(grads) == len(ref_grads)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, **TOL, msg=f"{label}: parameter gradient")
        assert state.keys() == ref_state.keys()
        for key in state:
            torch.testing.assert_close(state[key], ref_state[key], **TOL,
                                       msg=f"{label}: {key}")


def test_sync_batch_norm_errors_on_every_rank():
    """One value per channel over the global batch fails on every rank (torch's message);
    a 1-D input fails locally. The engine keeps working afterwards."""
    n, me = hvd.size(), hvd.rank()
    sync = hvd.SyncBatchNorm(C)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        sync(torch.ones(1 if me == 0 else 0, C))
    with pytest.raises(ValueError, match="at least 2D"):
        sync(torch.ones(C))
    total = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="sbn.after_errors")
    assert float(total) == n
