"""Bad input on one rank of the "mpicoll" backend raises on every rank within 2 s.

A table of cases x operations: the last rank passes a bad argument (a list of the wrong
length, a tensor of the wrong size, a bitwise op on floats, a tensor on the meta device,
bad split sizes, a root outside the group, mixed dtypes), the others good ones. The rank at
fault must raise its ``ValueError``/``TypeError`` and every other rank
:class:`mpicoll.RemoteError` naming it, each within :data:`LIMIT_S` of its call; twice in a
row (the second call of a kind is checked too), and the group must work afterwards. One
case makes the bad call from a DDP communication hook after DDP rebuilt its buckets.

Errors torch raises itself before the call reaches the backend (a non-tensor argument,
tensors of different dtypes in one ``dist.*`` call, a ``src``/``dst`` outside the group)
never reach the other ranks with any backend; the mixed-dtype and bad-root cases call the
group's own methods, as DTensor and FSDP do. Tensors on the meta device never reach any
backend through torch's group (torch's c10d ops have meta kernels that do nothing, for
gloo too): the meta cases call the mpicoll backend's methods (``backend_of(group)``).
"""
from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import mpicoll
from mpicoll.torch.distributed import backend_of
from test_dist_collectives import GATHER_INTO, SCATTER_FROM

pytestmark = pytest.mark.mpi

#: Seconds within which every rank must raise.
LIMIT_S = 2.0
I64 = torch.int64


@pytest.fixture(scope="module")
def group():
    """A group of every rank whose operations give up after 20 s (a case that hangs fails
    instead of waiting for the default 30 minutes)."""
    return dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=20))


def _ones(count: int, dtype: torch.dtype = I64) -> torch.Tensor:
    return torch.ones(count, dtype=dtype)


def _meta(count: int) -> torch.Tensor:
    return torch.empty(count, dtype=I64, device="meta")


def _opts(kind: str, root: int) -> object:
    opts = getattr(dist, kind)()
    opts.rootRank = root
    return opts


# each case: bad -> None, called with bad=True on the last rank only
def all_reduce_bitwise_float(g, n, bad):
    dist.all_reduce(_ones(3, torch.float32 if bad else I64), op=dist.ReduceOp.BAND, group=g)


def all_reduce_meta(g, n, bad):
    backend_of(g).allreduce([_meta(3) if bad else _ones(3)], dist.AllreduceOptions()).wait()


def broadcast_meta(g, n, bad):
    backend_of(g).broadcast([_meta(3) if bad else _ones(3)], dist.BroadcastOptions()).wait()


def broadcast_bad_root(g, n, bad):
    g.broadcast([_ones(3)], _opts("BroadcastOptions", n if bad else 0)).wait()


def reduce_bitwise_float(g, n, bad):
    dist.reduce(_ones(3, torch.float32 if bad else I64), group_dst=0, op=dist.ReduceOp.BOR,
                group=g)


def reduce_bad_root(g, n, bad):
    g.reduce([_ones(3)], _opts("ReduceOptions", -1 if bad else 0)).wait()


def all_gather_list_length(g, n, bad):
    dist.all_gather([_ones(3) for _ in range(n + bad)], _ones(3), group=g)


def all_gather_output_size(g, n, bad):
    outs = [_ones(3) for _ in range(n)]
    if bad:
        outs[-1] = _ones(4)
    dist.all_gather(outs, _ones(3), group=g)


def all_gather_mixed_dtypes(g, n, bad):
    outs = [_ones(3) for _ in range(n)]
    if bad:
        outs[0] = _ones(3, torch.int32)
    g.allgather([outs], [_ones(3)]).wait()


def all_gather_coalesced_list_length(g, n, bad):
    outs = [[_ones(3), _ones(2)] for _ in range(n + bad)]
    dist.all_gather_coalesced(outs, [_ones(3), _ones(2)], group=g)


def all_gather_into_tensor_size(g, n, bad):
    GATHER_INTO(_ones(3 * n + bad), _ones(3), group=g)


def gather_list_length(g, n, bad):
    root = n - 1
    outs = [_ones(3) for _ in range(n - bad)] if dist.get_rank(g) == root else None
    dist.gather(_ones(3), outs, group_dst=root, group=g)


def gather_element_size(g, n, bad):
    root = n - 1
    outs = [_ones(3 + (bad and i == 0)) for i in range(n)] if dist.get_rank(g) == root else None
    dist.gather(_ones(3), outs, group_dst=root, group=g)


def scatter_list_length(g, n, bad):
    root = n - 1
    ins = [_ones(3) for _ in range(n + bad)] if dist.get_rank(g) == root else None
    dist.scatter(_ones(3), ins, group_src=root, group=g)


def reduce_scatter_list_length(g, n, bad):
    """The issue's case: a list of the wrong length."""
    dist.reduce_scatter(_ones(3), [_ones(3) for _ in range(n + bad)], group=g)


def reduce_scatter_list_size(g, n, bad):
    """This rank's own input (uneven inputs are allowed, but the output must match it)."""
    ins = [_ones(3) for _ in range(n)]
    if bad:
        ins[-1] = _ones(5)
    dist.reduce_scatter(_ones(3), ins, group=g)


def reduce_scatter_tensor_size(g, n, bad):
    SCATTER_FROM(_ones(3), _ones(3 * n + bad), group=g)


def all_to_all_list_length(g, n, bad):
    dist.all_to_all([_ones(2) for _ in range(n)], [_ones(2) for _ in range(n + bad)], group=g)


def all_to_all_single_splits(g, n, bad):
    splits = [2] * n
    if bad:
        splits[0] = 3                  # they no longer sum to the input's rows
    dist.all_to_all_single(_ones(2 * n), _ones(2 * n), [2] * n, splits, group=g)


def all_to_all_single_rows(g, n, bad):
    output = _ones(2 * n).reshape(n, 2) if bad else _ones(2 * n)   # rows of 2, not 1
    dist.all_to_all_single(output, _ones(2 * n), group=g)


CASES = [all_reduce_bitwise_float, all_reduce_meta, broadcast_meta, broadcast_bad_root,
         reduce_bitwise_float, reduce_bad_root, all_gather_list_length, all_gather_output_size,
         all_gather_mixed_dtypes, all_gather_coalesced_list_length,
         all_gather_into_tensor_size, gather_list_length, gather_element_size,
         scatter_list_length, reduce_scatter_list_length, reduce_scatter_list_size,
         reduce_scatter_tensor_size, all_to_all_list_length, all_to_all_single_splits,
         all_to_all_single_rows]


def _expect_everywhere(call, g, bad_rank: int) -> None:
    """``call()`` raises on this rank within LIMIT_S: the local error where it is at fault,
    RemoteError naming the rank at fault elsewhere."""
    me = dist.get_rank(g)
    start = time.monotonic()
    with pytest.raises(Exception) as info:
        call()
    took = time.monotonic() - start
    exc = info.value
    if me == bad_rank:
        assert isinstance(exc, (ValueError, TypeError)), repr(exc)
    else:
        assert isinstance(exc, mpicoll.RemoteError), repr(exc)
        assert bad_rank in exc.errors, exc.errors
    assert took < LIMIT_S, f"raised after {took:.2f} s: {exc!r}"


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_bad_input_raises_on_every_rank(group, case):
    n = dist.get_world_size(group)
    bad_rank = n - 1
    me = dist.get_rank(group)
    for _ in range(2):           # a second call of the same kind is checked as well
        _expect_everywhere(lambda: case(group, n, me == bad_rank), group, bad_rank)
    case(group, n, False)        # the group works afterwards
    tensor = _ones(4)
    dist.all_reduce(tensor, group=group)
    assert torch.equal(tensor, torch.full((4,), n, dtype=I64))


def test_bad_input_from_a_ddp_hook_after_the_bucket_rebuild(group):
    """DDP re-packs its buckets after the first iteration; on the third the last rank's
    hook all-reduces with a bitwise op on float gradients: backward raises on every rank."""
    n = dist.get_world_size(group)
    me, bad_rank = dist.get_rank(group), n - 1
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(net, process_group=group,
                                                    bucket_cap_mb=1e-5)
    step = [0]

    def hook(state, bucket):
        op = dist.ReduceOp.BAND if me == bad_rank and step[0] == 2 else dist.ReduceOp.SUM
        work = dist.all_reduce(bucket.buffer(), op=op, group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0] / n)

    ddp.register_comm_hook(None, hook)
    x = torch.ones(2, 4)
    for step[0] in range(2):
        ddp(x).sum().backward()
    step[0] = 2
    start = time.monotonic()
    with pytest.raises(Exception) as info:
        ddp(x).sum().backward()
    took = time.monotonic() - start
    expected = "integer" if me == bad_rank else f"rank {bad_rank}"
    assert expected in str(info.value), repr(info.value)
    assert took < LIMIT_S, f"raised after {took:.2f} s"
    tensor = _ones(2)
    dist.all_reduce(tensor, group=group)
    assert torch.equal(tensor, torch.full((2,), n, dtype=I64))
