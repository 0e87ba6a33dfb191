"""The "mpicoll" backend's rooted, all-to-all, point-to-point and PREMUL_SUM operations
against references built from every rank's known data (integers: exact), odd counts,
every call twice; uneven all-to-all splits (some empty).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from test_dist_collectives import COUNTS, REDUCTIONS, SCATTER_FROM, data, everyone

pytestmark = pytest.mark.mpi


def cell(src: int, dst: int, count: int, rep: int) -> torch.Tensor:
    """What rank ``src`` sends rank ``dst``: values that name both, the index and ``rep``."""
    return torch.arange(count, dtype=torch.int64) * 1000 + src * 100 + dst * 10 + rep


def uneven(src: int, dst: int) -> int:
    """Rows ``src`` sends ``dst`` (0, 1 or 2: some pairs send nothing)."""
    return (src + 2 * dst) % 3


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("op", [dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MAX],
                         ids=str)
def test_reduce(op, count):
    rank, n = dist.get_rank(), dist.get_world_size()
    for root in range(n):
        for rep in range(2):
            tensor = data(rank, count, rep)
            dist.reduce(tensor, dst=root, op=op)
            if rank == root:
                assert torch.equal(tensor, REDUCTIONS[op](everyone(count, rep)))


@pytest.mark.parametrize("count", COUNTS)
def test_gather(count):
    rank, n = dist.get_rank(), dist.get_world_size()
    for root in range(n):
        for rep in range(2):
            outputs = ([torch.full((count,), -1, dtype=torch.int64) for _ in range(n)]
                       if rank == root else None)
            dist.gather(data(rank, count, rep), outputs, dst=root)
            if rank == root:
                for got, expected in zip(outputs, everyone(count, rep)):
                    assert torch.equal(got, expected)


@pytest.mark.parametrize("count", COUNTS)
def test_scatter(count):
    rank, n = dist.get_rank(), dist.get_world_size()
    for root in range(n):
        for rep in range(2):
            inputs = [cell(root, r, count, rep) for r in range(n)] if rank == root else None
            output = torch.full((count,), -1, dtype=torch.int64)
            dist.scatter(output, inputs, src=root)
            assert torch.equal(output, cell(root, rank, count, rep))


def test_all_to_all_list_uneven():
    rank, n = dist.get_rank(), dist.get_world_size()
    for rep in range(2):
        inputs = [cell(rank, r, uneven(rank, r) + 1, rep) for r in range(n)]
        outputs = [torch.full((uneven(r, rank) + 1,), -1, dtype=torch.int64) for r in range(n)]
        dist.all_to_all(outputs, inputs)
        for src, got in enumerate(outputs):
            assert torch.equal(got, cell(src, rank, uneven(src, rank) + 1, rep))


def test_all_to_all_single_even():
    rank, n = dist.get_rank(), dist.get_world_size()
    for rep in range(2):
        input = torch.cat([cell(rank, r, 3, rep) for r in range(n)])
        output = torch.full((3 * n,), -1, dtype=torch.int64)
        dist.all_to_all_single(output, input)
        assert torch.equal(output, torch.cat([cell(r, rank, 3, rep) for r in range(n)]))


def test_all_to_all_single_uneven_rows():
    """Rows of 2 elements; rank ``s`` sends ``uneven(s, d)`` rows to rank ``d``."""
    rank, n = dist.get_rank(), dist.get_world_size()

    def rows(src: int, dst: int, rep: int) -> torch.Tensor:
        return cell(src, dst, 2 * uneven(src, dst), rep).reshape(-1, 2)

    for rep in range(2):
        input = torch.cat([rows(rank, r, rep) for r in range(n)])
        expected = torch.cat([rows(r, rank, rep) for r in range(n)])
        output = torch.full_like(expected, -1)
        work = dist.all_to_all_single(
            output, input, output_split_sizes=[uneven(r, rank) for r in range(n)],
            input_split_sizes=[uneven(rank, r) for r in range(n)], async_op=True)
        work.wait()
        assert torch.equal(output, expected)


def test_send_recv_ring_with_tags():
    rank, n = dist.get_rank(), dist.get_world_size()
    if n == 1:
        pytest.skip("needs two ranks")
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    for rep in range(2):
        got_a = torch.full((7,), -1, dtype=torch.int64)
        got_b = torch.full((3, 2), -1.0, dtype=torch.float64)
        reqs = [dist.irecv(got_b, src=prv, tag=5), dist.irecv(got_a, src=prv, tag=4),
                dist.isend(cell(rank, nxt, 7, rep), dst=nxt, tag=4),
                dist.isend(cell(rank, nxt, 6, rep).double().reshape(3, 2), dst=nxt, tag=5)]
        for req in reqs:
            req.wait()
        assert torch.equal(got_a, cell(prv, rank, 7, rep))
        assert torch.equal(got_b, cell(prv, rank, 6, rep).double().reshape(3, 2))


def test_a_dropped_isend_still_sends_its_data():
    """An isend whose Work the caller drops, of a tensor nothing else holds: its buffer
    lives until MPI has sent it (it was freed and reused: the receiver got other data)."""
    import gc

    rank, n = dist.get_rank(), dist.get_world_size()
    if n == 1:
        pytest.skip("needs two ranks")
    count = 1 << 21          # 8 MB: sent only once the receiver is there
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    dist.isend(torch.arange(count, dtype=torch.float32) + rank, dst=nxt, tag=11)
    gc.collect()
    junk = [torch.full((count,), -1.0) for _ in range(4)]   # reuses freed memory
    dist.barrier()
    got = torch.zeros(count)
    dist.recv(got, src=prv, tag=11)
    assert torch.equal(got, torch.arange(count, dtype=torch.float32) + prv)
    del junk
    dist.barrier()


def test_recv_from_any_source():
    rank, n = dist.get_rank(), dist.get_world_size()
    if n == 1:
        pytest.skip("needs two ranks")
    if rank == 0:
        senders = set()
        for _ in range(n - 1):
            got = torch.full((5,), -1, dtype=torch.int64)
            src = dist.recv(got, tag=9)
            assert torch.equal(got, cell(src, 0, 5, 0))
            senders.add(src)
        assert senders == set(range(1, n))
    else:
        dist.send(cell(rank, 0, 5, 0), dst=0, tag=9)
    dist.barrier()


def test_batch_isend_irecv_both_directions():
    rank, n = dist.get_rank(), dist.get_world_size()
    if n == 1:
        pytest.skip("needs two ranks")
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    from_prv = torch.full((4,), -1, dtype=torch.int64)
    from_nxt = torch.full((4,), -1, dtype=torch.int64)
    ops = [dist.P2POp(dist.irecv, from_prv, prv), dist.P2POp(dist.irecv, from_nxt, nxt),
           dist.P2POp(dist.isend, cell(rank, nxt, 4, 0), nxt),
           dist.P2POp(dist.isend, cell(rank, prv, 4, 1), prv)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    assert torch.equal(from_prv, cell(prv, rank, 4, 0))
    assert torch.equal(from_nxt, cell(nxt, rank, 4, 1))


def test_premul_sum():
    from mpicoll.torch.distributed.tensors import premul_factor

    if premul_factor(dist._make_nccl_premul_sum(2.0)) is None:
        pytest.skip("this torch does not expose PREMUL_SUM's factor to Python (2.11 does not)")
    rank, n = dist.get_rank(), dist.get_world_size()
    for rep in range(2):
        tensor = data(rank, 9, rep, torch.float64)
        dist.all_reduce(tensor, op=dist._make_nccl_premul_sum(0.5 + rep))
        assert torch.equal(tensor, (0.5 + rep) * sum(everyone(9, rep, torch.float64)))
        full = data(rank, 3 * n, rep, torch.float64)
        output = torch.empty(3, dtype=torch.float64)
        SCATTER_FROM(output, full, op=dist._make_nccl_premul_sum(2.0))
        assert torch.equal(full, data(rank, 3 * n, rep, torch.float64))   # input untouched
        expected = 2.0 * sum(everyone(3 * n, rep, torch.float64))
        assert torch.equal(output, expected[3 * rank:3 * rank + 3])


def test_timeline_records_backend_operations(tmp_path):
    """mpicoll's collectives and the backend's MPI calls appear on the timeline (what the
    stall inspector reads too), on every rank."""
    import json

    from mpicoll import timeline

    rank, n = dist.get_rank(), dist.get_world_size()
    where = [str(tmp_path / "trace.json")]
    dist.broadcast_object_list(where, src=0)
    group = dist.new_group(list(range(n)))
    timeline.start(where[0])
    try:
        dist.all_reduce(data(rank, 5, 0), group=group)
        dist.gather(data(rank, 3, 0), [torch.empty(3, dtype=torch.int64) for _ in range(n)]
                    if rank == 0 else None, dst=0, group=group)
        dist.all_to_all_single(torch.empty(n, dtype=torch.int64),
                               torch.zeros(n, dtype=torch.int64), group=group)
        dist.barrier(group=group)
    finally:
        merged = timeline.stop()
    if rank == 0:
        events = json.loads(merged.read_text())["traceEvents"]
        for name in ("allreduce", "gather", "alltoall_single", "barrier"):
            assert {e["pid"] for e in events if e.get("name") == name} == set(range(n)), name
