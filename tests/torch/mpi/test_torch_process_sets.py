"""Horovod's process sets: collectives among subsets of the ranks (a 2 x 2 grid at n=4 for
hybrid data x tensor parallelism), registration rules, errors, shutdown."""
from __future__ import annotations

import copy

import pytest
import torch
from mpi4py import MPI

import mpicoll.torch as hvd

pytestmark = pytest.mark.mpi


@pytest.fixture
def grid():
    """At n=4: rows {0,1}, {2,3} (tensor parallel) and columns {0,2}, {1,3} (data
    parallel), registered on every rank; removed afterwards."""
    if hvd.size() != 4:
        pytest.skip("the grid needs 4 ranks")
    sets = [hvd.add_process_set(ranks) for ranks in ([0, 1], [2, 3], [0, 2], [1, 3])]
    me = hvd.rank()
    row = next(ps for ps in sets[:2] if me in ps.ranks)
    col = next(ps for ps in sets[2:] if me in ps.ranks)
    yield row, col, [ps for ps in sets if me not in ps.ranks]
    assert all(hvd.remove_process_set(ps) for ps in sets)


def test_grid_queries(grid):
    row, col, foreign = grid
    me = hvd.rank()
    assert (row.size(), col.size()) == (2, 2)
    assert row.rank() == me % 2 and col.rank() == me // 2
    assert row.included() and col.included()
    assert all(ps.included() is False for ps in foreign)
    with pytest.raises(ValueError, match="not part of provided process set"):
        foreign[0].rank()
    with pytest.raises(ValueError, match="this rank is not in"):
        hvd.allreduce(torch.ones(1), process_set=foreign[0])
    assert hvd.global_process_set.size() == 4 and hvd.global_process_set.rank() == me
    assert hvd.global_process_set.ranks == [0, 1, 2, 3]


def test_grid_collectives(grid):
    row, col, _ = grid
    me = hvd.rank()
    for rep in range(2):                                  # every call twice
        x = torch.full((3,), float(me + 1))
        assert torch.equal(hvd.allreduce(x, op=hvd.Sum, process_set=row, name=f"r{rep}"),
                           torch.full((3,), float(sum(r + 1 for r in row.ranks))))
        assert torch.equal(hvd.allreduce(x, process_set=col, name=f"c{rep}"),
                           torch.full((3,), sum(r + 1 for r in col.ranks) / 2))
        gathered = hvd.allgather(torch.full((1 + me, 2), float(me)), process_set=row)
        expected = torch.cat([torch.full((1 + r, 2), float(r)) for r in row.ranks])
        assert torch.equal(gathered, expected)
        root = col.ranks[1]                               # a global rank, as in Horovod
        out = hvd.broadcast(torch.full((2,), float(me)), root_rank=root, process_set=col)
        assert torch.equal(out, torch.full((2,), float(root)))
        sent = torch.arange(3.0) + 10 * me                # rows 0 | 1, 2 to the row's ranks
        received, splits = hvd.alltoall(sent, splits=[1, 2], process_set=row)
        mine = [0] if row.rank() == 0 else [1, 2]
        assert splits.tolist() == [len(mine)] * 2
        assert received.tolist() == [10 * r + i for r in row.ranks for i in mine]
        block = hvd.reducescatter(torch.ones(4, 2) * (me + 1), op=hvd.Sum, process_set=col)
        assert torch.equal(block, torch.full((2, 2), float(sum(r + 1 for r in col.ranks))))
        group = hvd.grouped_allreduce([torch.ones(2) * me, torch.ones(1, dtype=torch.int64)],
                                      op=hvd.Sum, process_set=row)
        assert group[0].tolist() == [float(sum(row.ranks))] * 2 and group[1].item() == 2
        hvd.barrier(process_set=col)


def test_grid_hybrid_step_with_both_sets_in_flight(grid):
    # Tensor parallel within a row (all-gather of activations, differentiable), data
    # parallel within a column (gradient average): handles on both sets at once.
    row, col, _ = grid
    me = hvd.rank()
    shard = torch.full((2, 3), float(me + 1), requires_grad=True)
    full = hvd.allgather(shard, process_set=row)          # (4, 3): the row's two shards
    (full * torch.arange(1.0, 5.0)[:, None]).sum().backward()
    # Horovod's all-gather gradient: the incoming gradient averaged over the set, own rows
    start = 2 * row.rank()
    assert torch.equal(shard.grad, torch.arange(1.0, 5.0)[start:start + 2, None].expand(2, 3))
    h_col = hvd.allreduce_async(shard.grad, name="dp.grad", process_set=col)
    h_row = hvd.allreduce_async(torch.ones(1) * me, op=hvd.Max, name="tp.max", process_set=row)
    assert hvd.synchronize(h_row).item() == max(row.ranks)
    assert torch.equal(hvd.synchronize(h_col), shard.grad)  # equal across the column
    y = hvd.broadcast(shard, root_rank=col.ranks[0], process_set=col)
    y.sum().backward()
    # broadcast's gradient: the average over the set on the root, zero elsewhere
    expected = 1.0 if me == col.ranks[0] else 0.0
    assert torch.equal(shard.grad - torch.arange(1.0, 5.0)[start:start + 2, None],
                       torch.full((2, 3), expected))


@pytest.mark.parametrize("bulk", [True, False])
def test_grid_distributed_optimizer_averages_over_its_set(grid, bulk):
    # Data parallel over the column: after step(), parameters equal the manual update
    # with the gradient averaged over the column only (both reduction modes).
    from mpicoll.torch.state import engine

    _, col, foreign = grid
    me = hvd.rank()
    layer = torch.nn.Linear(3, 2)
    with torch.no_grad():
        layer.weight.fill_(0.5)
        layer.bias.fill_(0.0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(layer.parameters(), lr=1.0),
                                         named_parameters=layer.named_parameters(),
                                         process_set=col)
    optimizer._bulk_mode = lambda: bulk                        # force the mode under test
    x = torch.full((1, 3), float(me + 1))
    layer(x).sum().backward()
    optimizer.step()
    mean = sum(r + 1 for r in col.ranks) / 2                  # d(sum)/dW = x, per rank
    assert torch.allclose(layer.weight, torch.full((2, 3), 0.5 - mean))
    assert torch.allclose(layer.bias, torch.full((2,), -1.0))
    assert engine().size == 4                                  # no set left in scope
    # A set this rank is not in: the optimizer trains locally, as Horovod's (no hooks,
    # nothing sent), so the update is this rank's own gradient.
    other = torch.nn.Linear(3, 2)
    outside = hvd.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=1.0),
                                       process_set=foreign[0])
    before = other.weight.detach().clone()
    other(x).sum().backward()
    outside.step()
    assert torch.equal(other.weight, before - x.expand(2, 3))


def test_unnamed_operations_in_a_set_leave_the_global_numbering_alone():
    """Unnamed operations only a set's ranks issue are numbered in the set: the unnamed
    global operations after them still match across ranks (they failed as 'can never
    complete' when one counter served every set)."""
    n, me = hvd.size(), hvd.rank()
    if n < 3:
        pytest.skip("needs a set smaller than the world")
    pair = hvd.add_process_set([0, 1])
    try:
        if me in (0, 1):
            assert hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=pair).tolist() == [2, 2]
            assert hvd.allgather(torch.ones(1), process_set=pair).tolist() == [1, 1]
            hvd.grouped_allreduce([torch.ones(1)], process_set=pair)
            hvd.reducescatter(torch.ones(2), process_set=pair)
        total = hvd.allreduce(torch.full((3,), float(me)), op=hvd.Sum)
        assert total.tolist() == [float(sum(range(n)))] * 3
        assert hvd.allgather(torch.tensor([me])).tolist() == list(range(n))
        assert len(hvd.grouped_allreduce([torch.ones(1), torch.ones(2)])) == 2
    finally:
        assert hvd.remove_process_set(pair)


def test_registration_errors_raise_on_every_rank():
    n, me = hvd.size(), hvd.rank()
    with pytest.raises(ValueError, match="out of range"):
        hvd.add_process_set([0, n])
    with pytest.raises(ValueError, match="duplicate"):
        hvd.add_process_set(list(range(n)))               # the global set
    if n > 1:
        with pytest.raises(ValueError, match="ranks disagree"):
            hvd.add_process_set([me])
    with pytest.raises(ValueError, match="unique"):
        hvd.ProcessSet([0, 0])
    with pytest.raises(NotImplementedError):
        hvd.ProcessSet(MPI.COMM_WORLD)
    assert hvd.remove_process_set(hvd.global_process_set) is False
    if n == 1:
        return                                            # [0] is the global set
    ps = hvd.add_process_set([0])
    twin = copy.copy(ps)                                  # a copy keeps the set's id
    with pytest.raises(ValueError, match="duplicate"):
        hvd.add_process_set([0])
    assert hvd.remove_process_set(ps) and ps.process_set_id is None
    assert hvd.remove_process_set(ps) is False
    assert ps.size() is None
    with pytest.raises(ValueError, match="does not exist or has not been registered"):
        twin.size()                                       # removed through the original
    assert hvd.remove_process_set(twin) is False


def test_init_with_process_sets_and_shutdown_forgets_them():
    if hvd.size() < 2:
        pytest.skip("needs 2 ranks")
    n = hvd.size()
    first, again = hvd.ProcessSet([n - 1, 0]), hvd.ProcessSet([0, n - 1])
    everyone = hvd.ProcessSet(range(n))                   # the global set's ranks
    hvd.shutdown()
    hvd.init(process_sets=[everyone, first, again])
    try:
        assert everyone.process_set_id is None            # a duplicate of the global set
        if n > 2:
            assert first.process_set_id is not None and again.process_set_id is None
            if hvd.rank() in (0, n - 1):
                out = hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=first)
                assert torch.equal(out, torch.full((2,), 2.0))
    finally:
        hvd.shutdown()
        assert first.process_set_id is None
        hvd.init()


def test_shutdown_fails_a_process_set_operation_waiting_for_the_leaver():
    n = hvd.size()
    if n < 3:
        pytest.skip("needs 3 ranks")
    last = n - 1
    pair = hvd.add_process_set([0, last])
    try:
        if hvd.rank() == last:
            hvd.shutdown()
        elif hvd.rank() == 0:
            with pytest.raises(hvd.CollectiveError, match=f"shut down by rank {last}"):
                hvd.allreduce(torch.ones(2), name="pair.x", process_set=pair)
    finally:
        hvd.shutdown()
        hvd.init()
        hvd.barrier()


def test_init_with_dynamic_process_sets_as_horovod_takes_it():
    """``hvd.init(process_sets="dynamic")`` (Horovod 0.28's call that allows sets added
    later) works: sets may be added afterwards (it raised TypeError)."""
    if hvd.size() < 2:
        pytest.skip("needs 2 ranks")
    hvd.shutdown()
    hvd.init(process_sets="dynamic")
    try:
        pair = hvd.add_process_set(range(hvd.size() - 1))
        if hvd.rank() in pair.ranks:
            expected = float(len(pair.ranks))
            assert hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=pair).tolist() \
                == [expected] * 2
        hvd.remove_process_set(pair)
    finally:
        hvd.shutdown()
        hvd.init()
