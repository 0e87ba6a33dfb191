"""Asynchronous operations and errors of the "mpicoll" backend: calls return before the
communication is done, complete in call order per group, and raise at ``wait()`` and
through their futures; bad or mismatched arguments raise on every rank (no hang).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import mpicoll
from test_dist_collectives import GATHER_INTO, data, everyone

pytestmark = pytest.mark.mpi


def needs_two() -> None:
    if dist.get_world_size() == 1:
        pytest.skip("needs two ranks")


def test_call_returns_before_the_others_join():
    """Ranks 1.. start an all-reduce; rank 0 joins only after rank 1 reported that its
    work was not complete yet (a message, not a timing)."""
    needs_two()
    rank = dist.get_rank()
    tensor = data(rank, 5, 0)
    if rank == 0:
        flag = torch.zeros(1, dtype=torch.int64)
        dist.recv(flag, src=1, tag=77)
        assert flag.item() == 1
        dist.all_reduce(tensor)
    else:
        work = dist.all_reduce(tensor, async_op=True)
        if rank == 1:
            dist.send(torch.tensor([0 if work.is_completed() else 1]), dst=0, tag=77)
        work.wait()
        assert work.is_completed()
    assert torch.equal(tensor, sum(everyone(5, 0)))


def test_many_outstanding_complete_in_order():
    """Twelve operations of different kinds and sizes queued at once, waited for in
    reverse order; a callback on each future records the order they completed in."""
    rank, n = dist.get_rank(), dist.get_world_size()
    order: list[int] = []
    tensors, works = [], []
    for i in range(12):
        tensor = data(rank, 2 * i + 1, i)
        if i % 3 == 2:
            work = dist.broadcast(tensor, src=i % n, async_op=True)
        else:
            work = dist.all_reduce(tensor, async_op=True)
        work.get_future().then(lambda fut, i=i: order.append(i))
        tensors.append(tensor)
        works.append(work)
    for work in reversed(works):
        work.wait()
    for i, tensor in enumerate(tensors):
        expected = (data(i % n, 2 * i + 1, i) if i % 3 == 2 else sum(everyone(2 * i + 1, i)))
        assert torch.equal(tensor, expected)
    dist.barrier()
    assert order == list(range(12))


def test_future_value_and_then():
    rank = dist.get_rank()
    tensor = data(rank, 7, 1)
    fut = dist.all_reduce(tensor, async_op=True).get_future()
    doubled = fut.then(lambda f: f.value()[0] * 2).wait()
    assert torch.equal(doubled, 2 * sum(everyone(7, 1)))


def test_collective_from_a_callback():
    """A future callback that starts and waits for another collective of the same group
    (as PowerSGD's hook does) neither deadlocks nor reorders."""
    rank = dist.get_rank()
    first, second = data(rank, 3, 0), data(rank, 4, 1)

    def then(fut):
        dist.all_reduce(second)
        return fut.value()[0]

    out = dist.all_reduce(first, async_op=True).get_future().then(then).wait()
    assert torch.equal(out, sum(everyone(3, 0)))
    assert torch.equal(second, sum(everyone(4, 1)))


def test_count_mismatch_raises_at_wait_on_every_rank():
    needs_two()
    rank, n = dist.get_rank(), dist.get_world_size()
    work = dist.all_reduce(torch.ones(3 + rank, dtype=torch.int64), async_op=True)
    with pytest.raises(mpicoll.MismatchError, match="count"):
        work.wait()
    with pytest.raises(mpicoll.MismatchError):
        work.get_future().wait()
    tensor = torch.ones(3, dtype=torch.int64)      # the group still works afterwards
    dist.all_reduce(tensor)
    assert torch.equal(tensor, torch.full((3,), n, dtype=torch.int64))


def test_dtype_mismatch_raises_on_every_rank():
    needs_two()
    dtype = torch.float32 if dist.get_rank() == 0 else torch.float64
    with pytest.raises(mpicoll.MismatchError, match="dtype"):
        dist.broadcast(torch.ones(4, dtype=dtype), src=0)


def test_bad_argument_on_one_rank_raises_on_every_rank():
    needs_two()
    rank, n = dist.get_rank(), dist.get_world_size()
    output = torch.empty(n * 4 + (1 if rank == n - 1 else 0), dtype=torch.int64)
    expected = ValueError if rank == n - 1 else mpicoll.RemoteError
    with pytest.raises(expected, match="output tensor must hold"):
        GATHER_INTO(output, torch.ones(4, dtype=torch.int64))


def test_all_to_all_split_mismatch_raises_on_every_rank():
    needs_two()
    rank, n = dist.get_rank(), dist.get_world_size()
    outs = [1] * n
    if rank == 0:
        outs = [2] + [1] * (n - 1)        # rank 0 expects two rows from itself
    input = torch.zeros(n, dtype=torch.int64)
    output = torch.zeros(sum(outs), dtype=torch.int64)
    with pytest.raises(mpicoll.CollectiveError if rank else ValueError, match="expects|rank 0"):
        dist.all_to_all_single(output, input, outs, [1] * n)


def test_different_operations_raise_on_every_rank():
    needs_two()
    tensor = torch.ones(4, dtype=torch.int64)
    with pytest.raises(mpicoll.MismatchError, match="collective"):
        if dist.get_rank() == 0:
            dist.all_reduce(tensor)
        else:
            dist.broadcast(tensor, src=0)


def test_bitwise_op_on_float_raises_on_every_rank():
    with pytest.raises(TypeError, match="integer"):
        dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND)


def test_wait_timeout_names_the_operation():
    """rank 0 is late (it waits for a message rank 1 sends after its timeout fired)."""
    needs_two()
    from datetime import timedelta

    rank = dist.get_rank()
    tensor = torch.ones(2)
    if rank == 0:
        dist.recv(torch.zeros(1), src=1, tag=78)
        dist.all_reduce(tensor)
    else:
        work = dist.all_reduce(tensor, async_op=True)
        if rank == 1:
            with pytest.raises(RuntimeError, match="allreduce timed out"):
                work.wait(timedelta(milliseconds=50))
            dist.send(torch.zeros(1), dst=0, tag=78)
        work.wait()
    assert torch.equal(tensor, torch.full((2,), float(dist.get_world_size())))
