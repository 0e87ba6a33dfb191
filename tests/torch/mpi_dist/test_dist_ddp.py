"""DistributedDataParallel on the "mpicoll" backend: n ranks, each with its shard of every
batch, train the same float64 model as one process on the concatenated batch, to 1e-10.

The shards differ per rank, so gradients that are not all-reduced give a different model.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

pytestmark = pytest.mark.mpi

STEPS, SHARD = 4, 3


def model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(),
                               torch.nn.Linear(6, 2)).double()


def batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(n * SHARD, 5, generator=gen, dtype=torch.float64)
    y = torch.randn(n * SHARD, 2, generator=gen, dtype=torch.float64)
    return x, y


def train(net: torch.nn.Module, shard: slice | None, n: int) -> None:
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(step, n)
        if shard is not None:
            x, y = x[shard], y[shard]
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()


@pytest.mark.parametrize("bucket_cap_mb", [25, 0.0001])   # one bucket; one per parameter
def test_ddp_equals_single_process(bucket_cap_mb):
    rank, n = dist.get_rank(), dist.get_world_size()
    reference = model()
    train(reference, None, n)

    local = model()
    if rank != 0:   # DDP's start-up broadcast must bring rank 0's parameters
        with torch.no_grad():
            for p in local.parameters():
                p.add_(rank)
    ddp = DistributedDataParallel(local, bucket_cap_mb=bucket_cap_mb)
    train(ddp, slice(rank * SHARD, (rank + 1) * SHARD), n)
    for got, expected in zip(ddp.module.parameters(), reference.parameters()):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)
