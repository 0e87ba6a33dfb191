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


def all_reduce_not_a_tensor(g, n, bad):
    backend_of(g).allreduce([[1, 1, 1] if bad else _ones(3)], dist.AllreduceOptions()).wait()


def all_reduce_sparse(g, n, bad):
    backend_of(g).allreduce([_ones(3).to_sparse() if bad else _ones(3)]).wait()


def all_reduce_max_complex(g, n, bad):
    """torch's ``dist.all_reduce`` refuses it itself; DTensor-like callers reach the group."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    tensor = torch.ones(3, dtype=torch.complex64) if bad else _ones(3)
    backend_of(g).allreduce([tensor], opts).wait()


def all_gather_lists_count(g, n, bad):
    """More output lists than input tensors."""
    outs = [[_ones(3) for _ in range(n)] for _ in range(1 + bad)]
    backend_of(g).allgather(outs, [_ones(3)]).wait()


def all_gather_into_coalesced_count(g, n, bad):
    backend_of(g).allgather_into_tensor_coalesced([_ones(3 * n)],
                                                  [_ones(3)] * (1 + bad)).wait()


def reduce_scatter_coalesced_count(g, n, bad):
    backend_of(g).reduce_scatter_tensor_coalesced([_ones(3)], [_ones(3 * n)] * (1 + bad)).wait()


def reduce_scatter_lists_count(g, n, bad):
    """More input lists than output tensors."""
    ins = [[_ones(3) for _ in range(n)] for _ in range(1 + bad)]
    backend_of(g).reduce_scatter([_ones(3)], ins).wait()


def reduce_scatter_uneven_dtype(g, n, bad):
    """Uneven inputs (rank 0's block is longer) and an output of another dtype."""
    ins = [_ones(3 + (i == 0)) for i in range(n)]
    out = _ones(ins[dist.get_rank(g)].numel(), torch.int32 if bad else I64)
    backend_of(g).reduce_scatter([out], [ins]).wait()


def gather_two_inputs(g, n, bad):
    outs = [[_ones(3) for _ in range(n)]] if dist.get_rank(g) == 0 else []
    g.gather(outs, [_ones(3)] * (1 + bad), _opts("GatherOptions", 0)).wait()


def gather_list_off_the_root(g, n, bad):
    """A rank other than the root passes an output list."""
    if n == 1:
        pytest.skip("needs a rank other than the root")
    me = dist.get_rank(g)
    outs = [[_ones(3) for _ in range(n)]] if me == 0 or bad else []
    g.gather(outs, [_ones(3)], _opts("GatherOptions", 0)).wait()


def all_to_all_mixed_dtypes(g, n, bad):
    outs = [_ones(2) for _ in range(n)]
    if bad:
        outs[0] = _ones(2, torch.int32)
    backend_of(g).alltoall(outs, [_ones(2) for _ in range(n)]).wait()


def all_to_all_single_dtype(g, n, bad):
    output = _ones(2 * n, torch.int32 if bad else I64)
    backend_of(g).alltoall_base(output, _ones(2 * n), [], []).wait()


def all_to_all_single_uneven(g, n, bad):
    """Rows that do not split evenly over the ranks, without split sizes."""
    if n == 1:
        pytest.skip("every row count splits over one rank")
    backend_of(g).alltoall_base(_ones(2 * n + bad), _ones(2 * n + bad), [], []).wait()


def all_reduce_premul_sum_int(g, n, bad):
    """PREMUL_SUM of an integer tensor (torch's own cast error before)."""
    tensor = _ones(3) if bad else _ones(3, torch.float32)
    dist.all_reduce(tensor, op=dist._make_nccl_premul_sum(2.0), group=g)


def broadcast_float8(g, n, bad):
    """A dtype the backend does not move (a bare KeyError before)."""
    dist.broadcast(_ones(3, torch.float8_e4m3fn if bad else torch.float32), group_src=0,
                   group=g)


CASES = [all_reduce_premul_sum_int, broadcast_float8, all_reduce_bitwise_float, all_reduce_meta, broadcast_meta, broadcast_bad_root,
         reduce_bitwise_float, reduce_bad_root, all_gather_list_length, all_gather_output_size,
         all_gather_mixed_dtypes, all_gather_coalesced_list_length,
         all_gather_into_tensor_size, gather_list_length, gather_element_size,
         scatter_list_length, reduce_scatter_list_length, reduce_scatter_list_size,
         reduce_scatter_tensor_size, all_to_all_list_length, all_to_all_single_splits,
         all_to_all_single_rows, all_reduce_not_a_tensor, all_reduce_sparse,
         all_reduce_max_complex, all_gather_lists_count, all_gather_into_coalesced_count,
         reduce_scatter_coalesced_count, reduce_scatter_lists_count, reduce_scatter_uneven_dtype,
         gather_two_inputs, gather_list_off_the_root, all_to_all_mixed_dtypes,
         all_to_all_single_dtype, all_to_all_single_uneven]


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


def test_point_to_point_bad_arguments_raise_at_the_call(group):
    """A send or receive of two tensors, to a rank outside the group or with a tag MPI
    cannot carry raises ``ValueError`` on the calling rank (no other rank is involved)."""
    backend = backend_of(group)
    me, n = dist.get_rank(group), dist.get_world_size(group)
    with pytest.raises(ValueError, match="take one tensor, not 2"):
        backend.send([_ones(2), _ones(2)], me, 0)
    with pytest.raises(ValueError, match=f"dst={n} is not a rank of the group"):
        backend.send([_ones(2)], n, 0)
    with pytest.raises(ValueError, match="src=-3 is not a rank of the group"):
        backend.recv([_ones(2)], -3, 0)
    with pytest.raises(ValueError, match="tag -1 is outside MPI's range"):
        backend.recv([_ones(2)], me, -1)


def test_unchecked_call_with_a_bad_argument_raises_at_the_call_on_its_rank_only():
    """``Options(check="first")``: the second all-reduce is not agreed on, so a bad
    argument raises this rank's own error at the call (not a ``RemoteError``, not at
    ``wait``), nothing is sent, and the group works afterwards. Every rank passes a bad
    argument (an unchecked good call would wait for the others): a meta tensor on even
    ranks, a bitwise op on floats on odd ones."""
    from mpicoll import config
    from mpicoll.torch.distributed import Options

    if config.check_enabled():
        pytest.skip("MPICOLL_CHECK agrees on every call")
    g = dist.new_group(list(range(dist.get_world_size())),
                       pg_options=Options(check="first"))
    backend, me, n = backend_of(g), dist.get_rank(g), dist.get_world_size(g)
    first = torch.full((3,), float(me + 1))
    backend.allreduce([first], dist.AllreduceOptions()).wait()     # the agreed first call
    assert torch.equal(first, torch.full((3,), n * (n + 1) / 2))
    opts = dist.AllreduceOptions()
    if me % 2:
        opts.reduceOp = dist.ReduceOp.BAND
        bad, kind, match = torch.ones(3), TypeError, "needs an integer or bool tensor"
    else:
        bad, kind, match = _meta(3), TypeError, "is on meta"
    sequence = backend._get_sequence_number_for_group()
    with pytest.raises(kind, match=match) as info:
        backend.allreduce([bad], opts)
    assert not isinstance(info.value, mpicoll.RemoteError)
    assert backend._get_sequence_number_for_group() == sequence + 1
    tensor = torch.arange(4, dtype=I64) * (me + 1)
    dist.all_reduce(tensor, group=g)
    assert torch.equal(tensor, torch.arange(4, dtype=I64) * (n * (n + 1) // 2))
    dist.destroy_process_group(g)


def test_a_receive_nobody_sends_times_out_then_completes(group):
    """``wait(timeout)`` on a receive without a matching send raises
    ``CollectiveTimeoutError``; the receive stays posted and takes the send made later."""
    backend = backend_of(group)
    me = dist.get_rank(group)
    got = torch.zeros(2, dtype=I64)
    work = backend.recv([got], me, 77)
    with pytest.raises(mpicoll.CollectiveTimeoutError, match="recv timed out"):
        work.wait(timedelta(seconds=0.2))
    sent = torch.tensor([me, 5], dtype=I64)
    backend.send([sent], me, 77).synchronize()      # c10d Work.synchronize: waits
    work.wait()
    assert torch.equal(got, sent)
