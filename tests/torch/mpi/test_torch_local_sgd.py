"""Local SGD and hierarchical SGD (issue 27): ``sync_every``, ``node_sync_every``,
``warmup_steps`` and ``average_state`` of ``DistributedOptimizer`` (both backends).

Every rank trains on its own data (seeded by rank and step), so replicas drift apart
between averages. Checked: replicas are bit-identical exactly on the steps (and within the
groups) that average, and differ otherwise; the trajectory equals an independent
float64 reference that simulates every rank in one process; ``sync_every=1`` and the
warm-up equal the ordinary optimizer bit for bit; optimizer state is averaged or kept
per rank as asked; bad or disagreeing settings raise on every rank.
"""
from __future__ import annotations

import os

import pytest
import torch
from mpi4py import MPI

import mpicoll
import mpicoll.torch as hvd
from mpicoll.context import get_context
from mpicoll.torch.local_sgd import LocalSGDSchedule, NODE, WORLD, check_settings

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
LR, MOMENTUM = 0.05, 0.9
#: Whether an all-reduce's sums are the same bit for bit however the engine fuses the
#: gradients (timing decides that with overlap): not with the ring forced, whose order of
#: addition depends on an element's place in the fused buffer.
LAYOUT_FREE = "ring" not in (os.environ.get("MPICOLL_ALGORITHM"),
                             os.environ.get("MPICOLL_ALLREDUCE_ALGORITHM"))


def _same(a: torch.Tensor, b: torch.Tensor, what: object) -> None:
    if LAYOUT_FREE:
        assert torch.equal(a, b), what
    else:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=str(what))


def _node_of_every_rank() -> list[int]:
    """The node index of every rank (mpicoll's layout: ``MPICOLL_RANKS_PER_NODE``)."""
    return COMM.allgather(get_context(COMM).topology.node_index)


def _model(dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(),
                               torch.nn.Linear(4, 3)).to(dtype)


def _batch(rank: int, step: int, dtype: torch.dtype = torch.float64
           ) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 5, generator=gen, dtype=dtype), torch.randn(6, 3, generator=gen,
                                                                      dtype=dtype)


def _loss(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = _batch(rank, step, next(model.parameters()).dtype)
    return ((model(x) - y) ** 2).mean()


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    opt.zero_grad()
    _loss(model, RANK, step).backward()
    opt.step()


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _same_as(mine: torch.Tensor) -> list[bool]:
    """For every rank: whether its tensor has exactly this rank's bits."""
    every = COMM.allgather(mine.numpy().tobytes())
    return [other == every[RANK] for other in every]


def _sgd(model: torch.nn.Module, **kwargs) -> torch.optim.Optimizer:
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR,
                                                    momentum=MOMENTUM),
                                    named_parameters=model.named_parameters(), **kwargs)


def _expected_identity(level: int, nodes: list[int]) -> list[bool]:
    """Which ranks must hold this rank's bits after a step of sync level ``level``; the
    others must differ (they trained on other data since the last common average)."""
    if level == WORLD:
        return [True] * SIZE
    if level == NODE:
        return [nodes[r] == nodes[RANK] for r in range(SIZE)]
    return [r == RANK for r in range(SIZE)]


@pytest.mark.parametrize("settings", [dict(sync_every=3),
                                      dict(sync_every=4, node_sync_every=1),
                                      dict(sync_every=4, node_sync_every=2, warmup_steps=2)],
                         ids=["H3", "H4M1", "H4M2K2"])
def test_identical_exactly_when_due(hvd, settings):
    model = _model()
    opt = _sgd(model, **settings)
    schedule = LocalSGDSchedule(check_settings(**settings))
    nodes = _node_of_every_rank()
    identity = []
    for step in range(1, 10):
        _train_step(model, opt, step)
        level = schedule.advance().level
        identity.append((step, _same_as(_flat(model)), _expected_identity(level, nodes)))
    assert [(s, got) for s, got, _ in identity] == [(s, want) for s, _, want in identity]
    assert opt.local_sgd.schedule.steps == 9


def _reference(settings: dict, steps: int, nodes: list[int], average_state: bool = True
               ) -> torch.Tensor:
    """This rank's parameters after ``steps`` steps, from every rank simulated in one
    process: momentum SGD on each rank's own data, then the parameters (and momentum
    buffers, with ``average_state``) of each group averaged in float64 (torch's averager
    order). Identical in exact arithmetic to what the optimizer does."""
    models = [_model() for _ in range(SIZE)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM) for m in models]
    schedule = LocalSGDSchedule(check_settings(**settings))
    for step in range(1, steps + 1):
        for r, (m, o) in enumerate(zip(models, opts)):
            o.zero_grad()
            _loss(m, r, step).backward()
            o.step()
        level = schedule.advance().level
        if level == NONE_LEVEL:
            continue
        groups = [list(range(SIZE))] if level == WORLD else \
            [[r for r in range(SIZE) if nodes[r] == n] for n in sorted(set(nodes))]
        for group in groups:
            tensors = [[p for p in models[r].parameters()] for r in group]
            if average_state:
                tensors = [ts + [opts[r].state[p]["momentum_buffer"] for p in ts]
                           for r, ts in zip(group, tensors)]
            with torch.no_grad():
                for same in zip(*tensors):
                    mean = torch.stack(list(same)).mean(0)
                    for t in same:
                        t.copy_(mean)
    return _flat(models[RANK])


NONE_LEVEL = 0


@pytest.mark.parametrize("settings", [dict(sync_every=2), dict(sync_every=3,
                                                               node_sync_every=1),
                                      dict(sync_every=4, node_sync_every=2, warmup_steps=1)],
                         ids=["H2", "H3M1", "H4M2K1"])
def test_matches_reference(hvd, settings):
    model = _model()
    opt = _sgd(model, **settings)
    for step in range(1, 8):
        _train_step(model, opt, step)
    expected = _reference(settings, 7, _node_of_every_rank())
    torch.testing.assert_close(_flat(model), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("make", ["sgd", "adam"])
def test_sync_every_1_and_warmup_equal_ordinary_training(hvd, mode, make):
    def build(**kwargs):
        model = _model(torch.float32)
        inner = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM) \
            if make == "sgd" else torch.optim.Adam(model.parameters(), lr=0.01)
        return model, hvd.DistributedOptimizer(
            inner, named_parameters=model.named_parameters(), **kwargs)

    plain, plain_opt = build()
    h1, h1_opt = build(sync_every=1)
    warm, warm_opt = build(sync_every=3, warmup_steps=4, average_state=False)
    hier, hier_opt = build(sync_every=2, node_sync_every=1, warmup_steps=4)
    for step in range(1, 6):
        for model, opt in ((plain, plain_opt), (h1, h1_opt), (warm, warm_opt),
                           (hier, hier_opt)):
            _train_step(model, opt, step)
        if step <= 4:
            _same(_flat(warm), _flat(plain), step)
            _same(_flat(hier), _flat(plain), step)
        _same(_flat(h1), _flat(plain), step)
        key = "exp_avg" if make == "adam" else "momentum_buffer"
        _same(h1_opt.state_dict()["state"][0][key], plain_opt.state_dict()["state"][0][key],
              step)
    assert h1_opt.local_sgd is None and warm_opt.local_sgd.schedule.steps == 5
    if SIZE > 1:   # step 5 was local: this rank's own gradients
        assert not torch.equal(_flat(warm), _flat(plain))


@pytest.mark.parametrize("average_state", [True, False])
@pytest.mark.parametrize("make", ["sgd", "adam"])
def test_optimizer_state(hvd, average_state, make):
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM) if make == "sgd" \
        else torch.optim.Adam(model.parameters(), lr=0.01, amsgrad=True)
    opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                   sync_every=2, average_state=average_state)
    keys = ["momentum_buffer"] if make == "sgd" else ["exp_avg", "exp_avg_sq",
                                                        "max_exp_avg_sq"]
    for step in range(1, 5):
        _train_step(model, opt, step)
        for p in model.parameters():
            for key in keys:
                same = _same_as(opt.state[p][key].detach().clone())
                want = step % 2 == 0 and average_state
                assert same == [want or r == RANK for r in range(SIZE)], (step, key)
            if make == "adam":   # the step counters stay equal everywhere
                assert all(_same_as(opt.state[p]["step"].detach().clone().reshape(1)))
        assert all(_same_as(_flat(model))) == (step % 2 == 0 or SIZE == 1)


def test_parameter_server_backend(hvd):
    settings = dict(sync_every=3, node_sync_every=1)
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR,
                                                   momentum=MOMENTUM),
                                   named_parameters=model.named_parameters(),
                                   backend="ps", num_servers="colocated", **settings)
    schedule = LocalSGDSchedule(check_settings(**settings))
    nodes = _node_of_every_rank()
    try:
        for step in range(1, 8):
            _train_step(model, opt, step)
            level = schedule.advance().level
            assert _same_as(_flat(model)) == _expected_identity(level, nodes), step
        # through the servers, summed in another order than the reference: to rounding
        torch.testing.assert_close(_flat(model), _reference(settings, 7, nodes),
                                   rtol=0, atol=1e-12)
        assert opt.local_sgd.stats()["params.world"] == 2
    finally:
        opt.close()
        opt.free()


def test_parameter_server_sync_every_1_is_ordinary(hvd):
    def run(**kwargs):
        model = _model(torch.float32)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                       named_parameters=model.named_parameters(),
                                       backend="ps", num_servers="colocated", **kwargs)
        for step in range(1, 4):
            _train_step(model, opt, step)
        opt.close()
        opt.free()
        return _flat(model)

    assert torch.equal(run(), run(sync_every=4, warmup_steps=3))


def test_parameter_server_separate_server_steps_nothing_locally(hvd):
    """``num_servers=1``: rank 0 serves (no local SGD driver there); the workers train on
    their own data and average their parameters through it every ``sync_every`` steps,
    as an in-process reference of the workers (plain SGD: no state to average)."""
    if SIZE == 1:
        pytest.skip("needs a server and a worker")
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters(),
                                   backend="ps", num_servers=1, sync_every=2)
    got = None
    if opt.is_server:
        assert opt.local_sgd is None
        opt.serve()
    else:
        assert opt.local_sgd is not None
        try:
            for step in range(1, 6):
                _train_step(model, opt, step)
        finally:
            opt.close()
        got = _flat(model)
        assert opt.local_sgd.stats()["params.world"] == 2
    opt.free()
    workers = list(range(1, SIZE))
    models = [_model() for _ in workers]
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    for step in range(1, 6):
        for r, m, o in zip(workers, models, opts):
            o.zero_grad()
            _loss(m, r, step).backward()
            o.step()
        if step % 2 == 0:
            with torch.no_grad():
                for same in zip(*(m.parameters() for m in models)):
                    mean = torch.stack(list(same)).mean(0)
                    for t in same:
                        t.copy_(mean)
    if got is not None:
        torch.testing.assert_close(got, _flat(models[RANK - 1]), rtol=0, atol=1e-12)


def test_node_step_averages_missing_and_sparse_gradients(hvd):
    """A node-level step (``node_sync_every``) averages the gradients within the node: a
    parameter without one gets zeros, a sparse one is made dense (against the node's
    ranks' gradients computed here)."""
    def build() -> torch.nn.ModuleDict:
        torch.manual_seed(5)
        return torch.nn.ModuleDict({"emb": torch.nn.Embedding(6, 3, sparse=True),
                                    "lin": torch.nn.Linear(3, 2),
                                    "unused": torch.nn.Linear(2, 2)}).double()

    def loss(m: torch.nn.ModuleDict, rank: int) -> torch.Tensor:
        idx = torch.tensor([rank % 6, (2 * rank + 1) % 6])
        return (m["lin"](m["emb"](idx)) ** 2).sum() * (rank + 1)

    model = build()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters(),
                                   sync_every=3, node_sync_every=1)
    assert opt.local_sgd.peek().grads == NODE
    model.zero_grad()                     # the module's: every gradient None
    loss(model, RANK).backward()
    assert model["emb"].weight.grad.is_sparse and model["unused"].weight.grad is None
    opt.synchronize()
    nodes = _node_of_every_rank()
    refs = []
    for r in [r for r in range(SIZE) if nodes[r] == nodes[RANK]]:
        m = build()
        loss(m, r).backward()
        refs.append({n: torch.zeros_like(p) if p.grad is None else p.grad.to_dense()
                     for n, p in m.named_parameters()})
    for name, p in model.named_parameters():
        assert not p.grad.is_sparse, name
        torch.testing.assert_close(p.grad, sum(ref[name] for ref in refs) / len(refs),
                                   rtol=0, atol=1e-14, msg=name)
    assert not model["unused"].weight.grad.any()
    with opt.skip_synchronize():
        opt.step()
    assert opt.local_sgd.stats()["grads.node"] == 1


def test_bfloat16_parameters_are_averaged(hvd):
    """A world step averages bfloat16 parameters (in float32, rounded back once) like any
    other (it raised numpy's TypeError for BFloat16 on every rank)."""
    p = torch.nn.Parameter(torch.full((5,), float(RANK + 1), dtype=torch.bfloat16))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=0.5), named_parameters=[("p", p)],
                                   sync_every=2)
    for step in range(2):
        opt.zero_grad()
        (p.float() * (step + 1)).sum().backward()
        opt.step()
    # each rank: (r + 1) - 0.5 * (1 + 2); the world step averages them
    want = sum(float(r + 1) - 1.5 for r in range(SIZE)) / SIZE
    assert p.dtype == torch.bfloat16
    assert torch.equal(p.detach(), torch.full((5,), want, dtype=torch.bfloat16))


def test_bad_settings_raise_on_every_rank(hvd):
    model = _model()
    for bad, kind, match in ((dict(sync_every=0), ValueError, "sync_every must be"),
                             (dict(sync_every=2.0), TypeError, "sync_every must be an int"),
                             (dict(sync_every=2, node_sync_every=2), ValueError,
                              "must be smaller"),
                             (dict(sync_every=2, warmup_steps=-1), ValueError, "warmup"),
                             (dict(sync_every=2, average_state="yes"), TypeError,
                              "average_state")):
        with pytest.raises(kind, match=match):
            _sgd(model, **bad)
    # disagreeing ranks: the same ValueError everywhere (never a hang)
    with pytest.raises(ValueError, match="differ across ranks") if SIZE > 1 else \
            _no_error():
        _sgd(model, sync_every=2 if RANK == 0 else 4)
    # one rank's bad setting: its own error there, RemoteError on the others
    if SIZE > 1:
        with pytest.raises(TypeError if RANK == SIZE - 1 else mpicoll.RemoteError):
            _sgd(model, sync_every=3 if RANK != SIZE - 1 else "3")
    # the parameter server: local steps need server_optimizer='sum'
    with pytest.raises(ValueError, match="server_optimizer='sum'"):
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                       named_parameters=model.named_parameters(),
                                       backend="ps", num_servers="colocated",
                                       server_optimizer="sgd", lr=LR, sync_every=2)
        opt.close()
    COMM.Barrier()


class _no_error:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
