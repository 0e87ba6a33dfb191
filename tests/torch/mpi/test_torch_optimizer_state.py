"""broadcast_optimizer_state for every optimizer class in torch.optim (issue 10).

Rank 0 takes rank-dependent steps (its state and hyperparameters differ from the other
ranks', whose state may be empty); after the broadcast every rank's ``state_dict()`` must
equal rank 0's, and one more identical step must keep the parameters identical.
"""
from __future__ import annotations

import pickle

import pytest
import torch

import mpicoll.torch as hvd

pytestmark = pytest.mark.mpi

OPTIMIZERS = sorted(name for name, cls in vars(torch.optim).items()
                    if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
                    and cls is not torch.optim.Optimizer)


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(7)
    if name == "SparseAdam":
        return torch.nn.Embedding(6, 3, sparse=True)
    if name == "Muon":                        # 2-D parameters only
        return torch.nn.Linear(4, 3, bias=False)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def _loss(model: torch.nn.Module, name: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if name == "SparseAdam":
        return (model(torch.tensor([seed % 6, 2, 5])) ** 2).sum()
    return (model(torch.randn(5, 4, generator=gen)) ** 2).sum()


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, name: str, seed: int) -> None:
    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = _loss(model, name, seed)
        loss.backward()
        return loss
    if name == "LBFGS":
        opt.step(closure)
    else:
        closure()
        opt.step()


def _canonical(state: dict) -> bytes:
    def plain(value):
        if isinstance(value, torch.Tensor):
            return ("tensor", str(value.dtype), tuple(value.shape), value.tolist())
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(plain(v) for v in value)
        return value
    return pickle.dumps(plain(state))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_broadcast_optimizer_state_every_torch_optimizer(name):
    me = hvd.rank()
    model = _model(name)
    cls = getattr(torch.optim, name)
    lr = 0.01 * (me + 1)                                  # hyperparameters differ too
    opt = cls(model.parameters(), lr=lr)
    for step in range(2 if me == 0 else me % 2):          # other ranks: empty or 1 step
        _step(model, opt, name, seed=100 * me + step)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    states = hvd.allgather_object(_canonical(opt.state_dict()))
    _step(model, opt, name, seed=999)                     # the same step everywhere
    params = hvd.allgather_object(_canonical(model.state_dict()))
    assert all(s == states[0] for s in states), name
    assert all(p == params[0] for p in params), name
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)


def test_broadcast_keeps_the_wrapped_optimizer_shared():
    """After broadcast_optimizer_state (load_state_dict on the other ranks) the user's
    optimizer still shares the DistributedOptimizer's state and param_groups, so a
    scheduler built on it changes the rate every rank trains at (it went on changing
    the replaced groups: rank 0 trained at 0.00625, the others at 0.1)."""
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    for _ in range(4):
        opt.zero_grad()
        model(torch.ones(2, 4) * (hvd.rank() + 1)).sum().backward()
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == inner.param_groups[0]["lr"] == 0.1 * 0.5 ** 4
    every = hvd.allgather_object(b"".join(p.detach().numpy().tobytes()
                                          for p in model.parameters()))
    assert all(e == every[0] for e in every)
