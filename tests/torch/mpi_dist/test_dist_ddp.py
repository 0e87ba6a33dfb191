"""DistributedDataParallel on the "mpicoll" backend: n ranks, each with its shard of every
batch, train the same float64 model as one process on the concatenated batch, to 1e-10.

Every DDP option whose communication differs is covered: bucket sizes, ``static_graph``,
``gradient_as_bucket_view``, ``find_unused_parameters`` (a branch used on some steps only,
and one never used), gradient accumulation under ``no_sync()``, and uneven inputs (rank
``r`` has ``2 + r`` batches) through ``torch.distributed.algorithms.join.Join``.

The shards differ per rank and every rank but 0 starts from other parameters, so gradients
that are not all-reduced, or parameters that are not broadcast, give a different model.
The helpers (:func:`model`, :func:`batch`, :func:`shard`, :func:`assert_same_model`) are
shared with the FSDP2 and hook suites of this folder.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

pytestmark = pytest.mark.mpi

STEPS, SHARD = 4, 3


class Branchy(torch.nn.Module):
    """A trunk, a branch used on even steps only (``use_branch``) and a layer never used."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh())
        self.branch = torch.nn.Linear(6, 6)
        self.unused = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 2)
        self.use_branch = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.trunk(x)
        if self.use_branch:
            h = torch.tanh(self.branch(h))
        return self.head(h)


def model(kind: str = "mlp") -> torch.nn.Module:
    """The test model, the same parameters on every call (seeded), float64."""
    torch.manual_seed(1234)
    if kind == "branchy":
        return Branchy().double()
    return torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(),
                               torch.nn.Linear(6, 2)).double()


def batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` for ``n`` ranks: ``n * SHARD`` samples."""
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(n * SHARD, 5, generator=gen, dtype=torch.float64)
    y = torch.randn(n * SHARD, 2, generator=gen, dtype=torch.float64)
    return x, y


def shard(rank: int) -> slice:
    """Rank ``rank``'s rows of every global batch."""
    return slice(rank * SHARD, (rank + 1) * SHARD)


def perturbed(net: torch.nn.Module, rank: int) -> torch.nn.Module:
    """``net`` with ``rank`` added to every parameter: DDP/FSDP must replace it by rank
    0's parameters."""
    with torch.no_grad():
        for p in net.parameters():
            p.add_(rank)
    return net


def assert_same_model(got: torch.nn.Module, expected: torch.nn.Module,
                      atol: float = 1e-10) -> None:
    pairs = list(zip(got.parameters(), expected.parameters(), strict=True))
    assert pairs
    for a, b in pairs:
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=atol)


def sgd(net: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)


def loss_of(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(net(x), y)


def train(net: torch.nn.Module, rows: slice | None, n: int, steps: int = STEPS,
          before_step=None) -> None:
    """``steps`` SGD steps on ``rows`` of each global batch (all of it: ``None``)."""
    opt = sgd(net)
    for step in range(steps):
        x, y = batch(step, n)
        if rows is not None:
            x, y = x[rows], y[rows]
        if before_step is not None:
            before_step(step)
        opt.zero_grad()
        loss_of(net, x, y).backward()
        opt.step()


def ddp_of(net: torch.nn.Module, **kwargs) -> DistributedDataParallel:
    return DistributedDataParallel(perturbed(net, dist.get_rank()), **kwargs)


@pytest.mark.parametrize("options", [
    {"bucket_cap_mb": 25},                                        # one bucket
    {"bucket_cap_mb": 0.0001},                                    # one bucket per parameter
    {"static_graph": True, "bucket_cap_mb": 0.0001},
    {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.0001},
], ids=["one-bucket", "bucket-per-param", "static-graph", "bucket-view"])
def test_ddp_equals_single_process(options):
    rank, n = dist.get_rank(), dist.get_world_size()
    reference = model()
    train(reference, None, n)
    ddp = ddp_of(model(), **options)
    train(ddp, shard(rank), n)
    assert_same_model(ddp.module, reference)


@pytest.mark.parametrize("static_graph", [False, True])
def test_ddp_find_unused_parameters(static_graph):
    """``find_unused_parameters=True``: a branch used on even steps only and a layer never
    used; their gradients are all-reduced when used, left alone (``None``) otherwise, on
    every rank alike. ``static_graph=True`` (which needs the same parameters used at every
    step): the branch on every step, the layer never used."""
    rank, n = dist.get_rank(), dist.get_world_size()

    def branch_on(net):
        return lambda step: setattr(net, "use_branch", static_graph or step % 2 == 0)

    reference = model("branchy")
    train(reference, None, n, before_step=branch_on(reference))
    local = model("branchy")
    ddp = ddp_of(local, find_unused_parameters=not static_graph, static_graph=static_graph,
                 bucket_cap_mb=0.0001)
    train(ddp, shard(rank), n, before_step=branch_on(local))
    assert_same_model(ddp.module, reference)
    assert ddp.module.unused.weight.grad is None
    assert torch.equal(ddp.module.unused.weight, reference.unused.weight)


ACCUMULATE = 3


def test_ddp_no_sync_accumulates():
    """``ACCUMULATE`` micro-batches per optimizer step, the first ones under ``no_sync()``
    (gradients only accumulated locally), the last one all-reduced: equal to one process
    accumulating the concatenated micro-batches."""
    rank, n = dist.get_rank(), dist.get_world_size()

    def run(net, rows, context):
        opt = sgd(net)
        for step in range(STEPS):
            opt.zero_grad()
            for micro in range(ACCUMULATE):
                x, y = batch(step * ACCUMULATE + micro, n)
                if rows is not None:
                    x, y = x[rows], y[rows]
                with context(micro):
                    loss_of(net, x, y).backward()
            opt.step()

    from contextlib import nullcontext

    reference = model()
    run(reference, None, lambda micro: nullcontext())
    ddp = ddp_of(model(), bucket_cap_mb=0.0001)
    run(ddp, shard(rank), lambda micro: ddp.no_sync() if micro < ACCUMULATE - 1
        else nullcontext())
    assert_same_model(ddp.module, reference)


def batches_of(rank: int) -> int:
    """Uneven inputs: rank ``r`` has ``2 + r`` batches."""
    return 2 + rank


def test_ddp_join_uneven_inputs():
    """Rank ``r`` trains on ``2 + r`` batches inside ``Join([ddp])``: ranks that ran out
    shadow the others' all-reduces with zeros, so step ``s`` averages the gradients of the
    ranks still running over all ``n`` ranks (DDP's default, ``divide_by_initial_world_size``),
    and the last rank's model is broadcast at the end."""
    rank, n = dist.get_rank(), dist.get_world_size()
    reference = model()
    opt = sgd(reference)
    for step in range(batches_of(n - 1)):
        x, y = batch(step, n)
        opt.zero_grad()
        active = [r for r in range(n) if step < batches_of(r)]
        loss = sum(loss_of(reference, x[shard(r)], y[shard(r)]) for r in active) / n
        loss.backward()
        opt.step()

    ddp = ddp_of(model(), bucket_cap_mb=0.0001)
    opt = sgd(ddp)
    with Join([ddp]):
        for step in range(batches_of(rank)):
            x, y = batch(step, n)
            opt.zero_grad()
            loss_of(ddp, x[shard(rank)], y[shard(rank)]).backward()
            opt.step()
    assert_same_model(ddp.module, reference)


def test_a_joining_process_leaves_ddp_start_up_to_the_state_sync(monkeypatch):
    """A process that joined a growing job (reconfigure.start_joining): its DDP modules do
    not synchronise at construction (the running ranks would not join in); the elastic
    state's first sync gives the module in the state rank 0's parameters and lays its
    buckets out as rank 0's, after which it trains as DDP; a module outside the state
    refuses its forward instead of training from its own parameters."""
    from mpicoll.torch.distributed import reconfigure  # noqa: PLC0415
    from mpicoll.torch.elastic import TorchState  # noqa: PLC0415

    rank, n = dist.get_rank(), dist.get_world_size()
    monkeypatch.setattr(reconfigure, "_held", None)
    reconfigure.start_joining()
    assert reconfigure.joining()
    kept = ddp_of(model(), bucket_cap_mb=0.0001)
    outside = ddp_of(model())
    # nothing was broadcast: rank r's parameters are still rank 0's + r (agreed, so that
    # a rank that finds otherwise fails the test on every rank, not in the sync below)
    unsynced = all(torch.equal(a, b) for a, b in zip(
        kept.module.parameters(), perturbed(model(), rank).parameters(), strict=True))
    everywhere = torch.tensor([float(unsynced)])
    dist.all_reduce(everywhere, op=dist.ReduceOp.MIN)
    assert everywhere.item() == 1.0, "a DDP module built while joining synchronised"
    TorchState(model=kept).sync()
    assert not reconfigure.joining()
    reference = model()
    assert_same_model(kept.module, reference)
    train(reference, None, n)
    train(kept, shard(rank), n)
    assert_same_model(kept.module, reference)
    with pytest.raises(RuntimeError, match="not in the elastic state"):
        outside(batch(0, n)[0])
    # after the first sync a new DDP module synchronises as usual
    assert_same_model(ddp_of(model()).module, model())


def test_elastic_state_broadcast_without_hvd_reaches_non_contiguous_tensors():
    """Without ``hvd.init()`` the elastic state's syncs broadcast over the world; a tensor
    whose host copy is not its own memory (a non-contiguous one: a transposed buffer)
    gets rank 0's values copied back into it."""
    from mpicoll.torch.elastic.state import broadcast_tensors
    from mpicoll.torch.elastic.world import hvd_started

    if hvd_started():
        pytest.skip("hvd.init() has run in this process")
    rank = dist.get_rank()
    base = torch.arange(6, dtype=torch.float64).reshape(2, 3) + 10 * rank
    plain = torch.full((4,), float(rank))
    transposed = base.t()
    assert not transposed.is_contiguous()
    broadcast_tensors({"t": transposed, "plain": plain}, root_rank=0)
    assert torch.equal(base, torch.arange(6, dtype=torch.float64).reshape(2, 3))
    assert torch.equal(plain, torch.zeros(4))
