"""torch.distributed's collectives on the "mpicoll" backend against references built from
every rank's known data (integers: exact), odd counts, every call twice.

Data depend on rank, element index and repetition, so a collective that does not
communicate, or returns its own input, fails.
"""
from __future__ import annotations

import functools
import operator

import numpy as np
import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.mpi

COUNTS = [1, 7, 33]


def data(rank: int, count: int, rep: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Rank-, index- and repetition-dependent values, small enough for exact products."""
    values = (np.arange(count) * 3 + rank * 5 + rep) % 7 + 1
    return torch.tensor(values, dtype=dtype)


def everyone(count: int, rep: int, dtype: torch.dtype = torch.int64) -> list[torch.Tensor]:
    return [data(r, count, rep, dtype) for r in range(dist.get_world_size())]


REDUCTIONS = {
    dist.ReduceOp.SUM: lambda ts: functools.reduce(operator.add, ts),
    dist.ReduceOp.PRODUCT: lambda ts: functools.reduce(operator.mul, ts),
    dist.ReduceOp.MIN: lambda ts: functools.reduce(torch.minimum, ts),
    dist.ReduceOp.MAX: lambda ts: functools.reduce(torch.maximum, ts),
    dist.ReduceOp.BAND: lambda ts: functools.reduce(operator.and_, ts),
    dist.ReduceOp.BOR: lambda ts: functools.reduce(operator.or_, ts),
    dist.ReduceOp.BXOR: lambda ts: functools.reduce(operator.xor, ts),
}


def test_backend_name():
    assert dist.get_backend() == "mpicoll"
    from mpi4py import MPI

    assert dist.get_rank() == MPI.COMM_WORLD.Get_rank()
    assert dist.get_world_size() == MPI.COMM_WORLD.Get_size()


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("op", list(REDUCTIONS), ids=str)
def test_all_reduce(op, count):
    rank = dist.get_rank()
    for rep in range(2):
        tensor = data(rank, count, rep)
        work = dist.all_reduce(tensor, op=op, async_op=True)
        work.wait()
        expected = REDUCTIONS[op](everyone(count, rep))
        assert torch.equal(tensor, expected)
        assert torch.equal(work.get_future().wait()[0], expected)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_all_reduce_float_sum_avg(dtype):
    rank, n = dist.get_rank(), dist.get_world_size()
    for rep in range(2):
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            tensor = data(rank, 9, rep, dtype)
            dist.all_reduce(tensor, op=op)
            expected = sum(t.double() for t in everyone(9, rep))
            if op == dist.ReduceOp.AVG:
                expected = expected / n
            tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
            torch.testing.assert_close(tensor.double(), expected, rtol=tol, atol=tol)


def test_all_reduce_non_contiguous():
    rank = dist.get_rank()
    for rep in range(2):
        base = torch.stack([data(rank, 5, rep), data(rank, 5, rep + 1)], dim=1)  # 5 x 2
        view = base.t()                                                          # not contiguous
        dist.all_reduce(view)
        expected = torch.stack([sum(everyone(5, rep)), sum(everyone(5, rep + 1))])
        assert torch.equal(base.t(), expected)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_all_reduce_coalesced():
    rank = dist.get_rank()
    for rep in range(2):
        tensors = [data(rank, c, rep) for c in COUNTS]
        dist.all_reduce_coalesced(tensors)
        for count, tensor in zip(COUNTS, tensors):
            assert torch.equal(tensor, sum(everyone(count, rep)))


@pytest.mark.parametrize("count", COUNTS)
def test_broadcast(count):
    rank, n = dist.get_rank(), dist.get_world_size()
    for root in range(n):
        for rep in range(2):
            tensor = data(rank, count, rep)
            work = dist.broadcast(tensor, src=root, async_op=True)
            work.wait()
            assert torch.equal(tensor, data(root, count, rep))


@pytest.mark.parametrize("count", COUNTS)
def test_all_gather(count):
    rank, n = dist.get_rank(), dist.get_world_size()
    for rep in range(2):
        outputs = [torch.full((count,), -1, dtype=torch.int64) for _ in range(n)]
        dist.all_gather(outputs, data(rank, count, rep))
        for got, expected in zip(outputs, everyone(count, rep)):
            assert torch.equal(got, expected)


#: torch 2.13's names where it has them (earlier: all_gather_into_tensor, reduce_scatter_tensor)
GATHER_INTO = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
SCATTER_FROM = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

GATHER_INTO_NAMES = [name for name in ("all_gather_into_tensor", "all_gather_single")
               if hasattr(dist, name)]
REDUCE_SCATTER_NAMES = [name for name in ("reduce_scatter_tensor", "reduce_scatter_single")
                  if hasattr(dist, name)]


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("name", GATHER_INTO_NAMES)
@pytest.mark.parametrize("count", COUNTS)
def test_all_gather_into_tensor(count, name):
    rank, n = dist.get_rank(), dist.get_world_size()
    for rep in range(2):
        output = torch.full((n * count,), -1, dtype=torch.int64)
        work = getattr(dist, name)(output, data(rank, count, rep), async_op=True)
        work.wait()
        assert torch.equal(output, torch.cat(everyone(count, rep)))


@pytest.mark.parametrize("count", [1, 5])
@pytest.mark.parametrize("where", ["own-block", "shifted"])
def test_all_gather_into_tensor_from_inside_the_output(count, where):
    """FSDP2 gathers in place: the input is this rank's block of the output ("own-block").
    An input overlapping the output elsewhere ("shifted": one element further on) must be
    read before it is overwritten. Every rank's block is rank-dependent."""
    rank, n = dist.get_rank(), dist.get_world_size()
    expected = torch.cat(everyone(count, 0))
    output = torch.full((n * count + 1,), -1, dtype=torch.int64)
    start = rank * count + (where == "shifted")
    output[start:start + count] = data(rank, count, 0)
    dist.all_gather_into_tensor(output[:n * count], output[start:start + count])
    assert torch.equal(output[:n * count], expected)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("name", REDUCE_SCATTER_NAMES)
@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("op", [dist.ReduceOp.SUM, dist.ReduceOp.MAX], ids=str)
def test_reduce_scatter_tensor(count, op, name):
    rank, n = dist.get_rank(), dist.get_world_size()
    for rep in range(2):
        output = torch.full((count,), -1, dtype=torch.int64)
        work = getattr(dist, name)(output, data(rank, n * count, rep), op=op,
                                          async_op=True)
        work.wait()
        full = REDUCTIONS[op](everyone(n * count, rep))
        assert torch.equal(output, full[rank * count:(rank + 1) * count])


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", [dist.ReduceOp.SUM, dist.ReduceOp.MAX], ids=str)
def test_reduce_scatter_tensor_into_a_block_of_its_input(op, dtype):
    """The output a block of the input (in place, as torch and gloo allow): the same
    result as into a separate tensor (it raised an overlap error on every dtype but
    bfloat16)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    for rep in range(2):
        buf = data(rank, 3 * n + 1, rep, dtype)
        dist.reduce_scatter_tensor(buf[3 * rank:3 * rank + 3], buf[:3 * n], op=op)
        full = REDUCTIONS[op](everyone(3 * n + 1, rep, dtype))
        assert torch.equal(buf[3 * rank:3 * rank + 3], full[3 * rank:3 * rank + 3])


def test_reduce_scatter_list():
    rank, n = dist.get_rank(), dist.get_world_size()
    for rep in range(2):
        output = torch.full((3,), -1, dtype=torch.int64)
        dist.reduce_scatter(output, list(data(rank, 3 * n, rep).split(3)))
        full = sum(everyone(3 * n, rep))
        assert torch.equal(output, full[rank * 3:(rank + 1) * 3])


def test_barrier_and_objects():
    n = dist.get_world_size()
    for _ in range(2):
        dist.barrier()
    objects = [None] * n
    dist.all_gather_object(objects, {"rank": dist.get_rank()})
    assert objects == [{"rank": r} for r in range(n)]


def test_new_group():
    rank, n = dist.get_rank(), dist.get_world_size()
    members = list(range(n - 1, -1, -2))          # every other rank, from the last
    group = dist.new_group(members)
    if rank in members:
        assert dist.get_world_size(group) == len(members)
        for rep in range(2):
            tensor = data(rank, 7, rep)
            dist.all_reduce(tensor, group=group)
            assert torch.equal(tensor, sum(data(r, 7, rep) for r in members))
    dist.barrier()


def test_bad_op_for_float():
    with pytest.raises(TypeError, match="integer"):
        dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND)


def test_first_call_mismatch_raises_everywhere():
    """Ranks that disagree on the first all-reduce of a group get MismatchError, no hang."""
    import mpicoll

    n = dist.get_world_size()
    if n == 1:
        pytest.skip("needs two ranks")
    group = dist.new_group(list(range(n)))
    with pytest.raises(mpicoll.MismatchError):
        dist.all_reduce(torch.ones(3 + dist.get_rank(), dtype=torch.int64), group=group)
    tensor = torch.ones(3, dtype=torch.int64)       # the group still works afterwards
    dist.all_reduce(tensor, group=group)
    assert torch.equal(tensor, torch.full((3,), n, dtype=torch.int64))
