"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on the "mpicoll" backend: every Linear
layer and the root sharded over a one-dimensional CPU device mesh of all ranks; n ranks,
each with its shard of every batch, train the same float64 model as one process on the
concatenated batch, to 1e-10.

FSDP2 gathers each layer's parameters with ``all_gather_into_tensor`` (in place: each
rank's input is its own block of the output) before its forward and backward, and
reduce-scatters the gradients with ``reduce_scatter_tensor``; the layers' first dimensions
(6, 6 and 2 rows) do not divide by 4 (padded shards) and 2 rows over 3 or 4 ranks leave
some ranks an empty shard. FSDP2 does not broadcast parameters: every rank starts from the
same seeded model.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from test_dist_ddp import assert_same_model, model, shard, train

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_fsdp2_equals_single_process(reshard_after_forward):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    rank, n = dist.get_rank(), dist.get_world_size()
    reference = model()
    train(reference, None, n)

    net = model()
    mesh = init_device_mesh("cpu", (n,))
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(net, mesh=mesh, reshard_after_forward=reshard_after_forward)
    assert all(isinstance(p, DTensor) for p in net.parameters())
    train(net, shard(rank), n)

    gathered = model()
    with torch.no_grad():
        for mine, sharded in zip(gathered.parameters(), net.parameters(), strict=True):
            mine.copy_(sharded.full_tensor())
    assert_same_model(gathered, reference)
