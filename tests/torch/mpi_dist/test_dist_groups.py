"""Subgroups of the "mpicoll" backend: ``new_group`` of sizes 1 to 3 (ranks passed in
descending order; torch numbers them in ascending order), two groups' operations interleaved, :func:`split_group`, a 2 x 2
device mesh with DTensor, and :func:`monitored_barrier` naming a missing rank.
"""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from mpicoll.torch import distributed as mdist
from test_dist_collectives import data
from test_dist_ops import cell

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("size", [1, 2, 3])
def test_subgroup_collectives(size):
    rank, n = dist.get_rank(), dist.get_world_size()
    if size > n:
        pytest.skip(f"needs {size} ranks")
    members = sorted({(n - 1 - 2 * i) % n for i in range(size)})   # torch sorts them
    if len(members) < size:
        members = list(range(n - size, n))
    group = dist.new_group(members[::-1])
    if rank in members:
        me = dist.get_rank(group)
        assert me == members.index(rank) and dist.get_world_size(group) == size
        for rep in range(2):
            tensor = data(rank, 7, rep)
            dist.all_reduce(tensor, group=group)
            assert torch.equal(tensor, sum(data(r, 7, rep) for r in members))
            tensor = data(rank, 5, rep)
            dist.broadcast(tensor, group_src=size - 1, group=group)
            assert torch.equal(tensor, data(members[-1], 5, rep))
            output = torch.full((2 * size,), -1, dtype=torch.int64)
            dist.all_to_all_single(output, torch.cat([cell(me, d, 2, rep) for d in range(size)]),
                                   group=group)
            assert torch.equal(output, torch.cat([cell(s, me, 2, rep) for s in range(size)]))
    dist.barrier()


def test_two_groups_interleaved():
    rank, n = dist.get_rank(), dist.get_world_size()
    world = dist.new_group(list(range(n)))
    evens = dist.new_group(list(range(0, n, 2)))
    works, tensors = [], []
    for rep in range(3):
        a = data(rank, 5, rep)
        works.append(dist.all_reduce(a, group=world, async_op=True))
        tensors.append((a, sum(data(r, 5, rep) for r in range(n))))
        if rank % 2 == 0:
            b = data(rank, 3, rep)
            works.append(dist.all_reduce(b, group=evens, async_op=True))
            tensors.append((b, sum(data(r, 3, rep) for r in range(0, n, 2))))
    for work in works:
        work.wait()
    for got, expected in tensors:
        assert torch.equal(got, expected)


def test_split_group():
    rank, n = dist.get_rank(), dist.get_world_size()
    parts = [list(range(i, n, 2)) for i in range(min(2, n))]
    group = mdist.split_group(split_ranks=parts)
    mine = parts[rank % 2]
    assert dist.get_world_size(group) == len(mine)
    tensor = data(rank, 9, 0)
    dist.all_reduce(tensor, group=group)
    assert torch.equal(tensor, sum(data(r, 9, 0) for r in mine))
    alone = mdist.split_group(split_ranks=[[0]])       # ranks named nowhere get None
    assert (alone is None) == (rank != 0)
    dist.barrier()


@pytest.mark.parametrize("parts, message", [
    ([], "cannot be None or empty"), ([[0, 0]], "empty or repeats a rank"),
    ([[0], [0]], "overlap: \\[0\\]"), ([[0, 99]], "outside the parent group")])
def test_split_group_refuses_bad_split_ranks(parts, message):
    """Every rank passes the same bad ``split_ranks``: each raises ``ValueError`` naming
    the fault, and no group is made (the world works afterwards)."""
    with pytest.raises(ValueError, match=message):
        mdist.split_group(split_ranks=parts)
    tensor = torch.ones(2)
    dist.all_reduce(tensor)
    assert torch.equal(tensor, torch.full((2,), float(dist.get_world_size())))


def test_device_mesh_and_dtensor():
    n = dist.get_world_size()
    if n != 4:
        pytest.skip("a 2 x 2 mesh needs four ranks")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rank = dist.get_rank()
    coords = (rank // 2, rank % 2)
    for dim, name in enumerate(("dp", "tp")):
        group = mesh.get_group(name)
        assert dist.get_world_size(group) == 2
        peers = [r for r in range(4) if (r // 2, r % 2)[1 - dim] == coords[1 - dim]]
        tensor = data(rank, 7, dim)
        dist.all_reduce(tensor, group=group)
        assert torch.equal(tensor, sum(data(r, 7, dim) for r in peers))
    full = torch.arange(8 * 6, dtype=torch.float64).reshape(8, 6)
    dt = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    assert dt.to_local().shape == (4, 3)
    assert torch.equal(dt.full_tensor(), full)
    replicated = dt.redistribute(mesh, [Replicate(), Replicate()])
    assert torch.equal(replicated.to_local(), full)
    assert torch.equal((dt + dt).full_tensor(), 2 * full)
    assert torch.equal(dt.sum().full_tensor(), full.sum())


def test_monitored_barrier_leaves_the_users_messages_alone():
    """A message sent before a monitored barrier with the tag the barrier counts to (its
    tokens had that tag on the same communicator) reaches the user's receive after it,
    intact (the barrier took it, and the receive got a token: 0 for 7)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    if n == 1:
        return
    backend = mdist.backend_of(dist.group.WORLD)
    for _ in range(3):
        tag = backend._monitored + 1                  # the next barrier's count
        sent = torch.arange(4, dtype=torch.float64) + 100 + tag
        work = dist.isend(sent, (rank + 1) % n, tag=tag)
        mdist.monitored_barrier(timeout=timedelta(seconds=30))
        got = torch.zeros(4, dtype=torch.float64)
        dist.recv(got, (rank - 1) % n, tag=tag)
        work.wait()
        assert torch.equal(got, sent), (tag, got)
    dist.barrier()


def test_monitored_barrier():
    rank, n = dist.get_rank(), dist.get_world_size()
    mdist.monitored_barrier(timeout=timedelta(seconds=30))
    if n == 1:
        return
    late = n - 1
    if rank == 0:
        with pytest.raises(RuntimeError, match=f"Rank {late} failed to pass monitoredBarrier"):
            mdist.monitored_barrier(timeout=timedelta(seconds=1))
    elif rank != late:
        with pytest.raises(RuntimeError, match="not released by rank 0"):
            mdist.monitored_barrier(timeout=timedelta(seconds=1))
    dist.barrier()
    if rank == late:    # it comes at last: rank 0 no longer waits, so it is not released
        with pytest.raises(RuntimeError, match="not released by rank 0"):
            mdist.monitored_barrier(timeout=timedelta(seconds=1))
    mdist.monitored_barrier(timeout=timedelta(seconds=30), wait_all_ranks=True)


def test_monitored_barrier_on_a_group_this_rank_is_not_in():
    """On the ranks outside a subgroup (``new_group`` gives them ``NON_GROUP_MEMBER``)
    the barrier returns at once; its members pass it."""
    group = dist.new_group([0])
    mdist.monitored_barrier(group, timeout=timedelta(seconds=30))
    if dist.get_rank() != 0:
        assert group == dist.GroupMember.NON_GROUP_MEMBER
    dist.barrier()


def test_a_group_under_torch_distributed_debug_detail():
    """``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (here set in the process): torch wraps each new
    group in its ``ProcessGroupWrapper``, which asks the backend for its sequence number
    before every collective (a backend without one is refused when the group is made) and
    compares the collectives across ranks: the group works, and a shape that differs on
    one rank is caught on every rank by torch's check."""
    rank, n = dist.get_rank(), dist.get_world_size()
    before = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        group = dist.new_group(list(range(n)))
    finally:
        dist.set_debug_level(before)
    backend = group._get_backend(torch.device("cpu"))
    for rep in range(2):
        tensor = data(rank, 7, rep)
        dist.all_reduce(tensor, group=group)
        assert torch.equal(tensor, sum(data(r, 7, rep) for r in range(n)))
    dist.barrier(group=group)
    assert backend._get_sequence_number_for_group() >= 3
    if n > 1:
        with pytest.raises(RuntimeError, match="mismatch between collectives"):
            dist.all_reduce(torch.ones(3 + rank), group=group)
    dist.destroy_process_group(group)
