"""The "mpicoll" backend as a real c10d backend: torch's ``ProcessGroup`` holds it for the
"cpu" and "cuda" devices (as gloo's and NCCL's), its ``Options`` and timeouts work as
gloo's, ``Work.get_future_result()`` reports outcomes, and list-form ``all_gather`` and
``reduce_scatter`` take inputs of different sizes per rank (as NCCL; gloo takes them for
``reduce_scatter`` only).
"""
from __future__ import annotations

import copy
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend, WorkResult

import mpicoll
from mpicoll.errors import CollectiveTimeoutError
from mpicoll.torch.distributed import MPIProcessGroup, Options, backend_of
from mpicoll.torch.distributed.work import MPIWork
from test_dist_collectives import data, everyone

pytestmark = pytest.mark.mpi

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def needs_two() -> None:
    if dist.get_world_size() == 1:
        pytest.skip("needs two ranks")


def test_backend_registered_for_cpu_and_cuda():
    """``_get_backend`` gives the mpicoll backend for both devices, and the group's
    configuration says so (before: "No backend type associated with device type cpu")."""
    n = dist.get_world_size()
    for group in (dist.group.WORLD, dist.new_group(list(range(n)))):
        assert type(group) is dist.ProcessGroup
        cpu = group._get_backend(CPU)
        assert isinstance(cpu, MPIProcessGroup) and group._get_backend(CUDA) is cpu
        assert set(group._device_types) == {CPU, CUDA}
        assert dist.get_backend_config(group) == "cpu:mpicoll,cuda:mpicoll"
        assert dist.get_backend(group) == "mpicoll" and cpu.name() == "mpicoll"
        assert (cpu.rank(), cpu.size()) == (dist.get_rank(group), n)
        assert backend_of(group) is cpu
        assert cpu.group_uid == group.group_name      # torch named the backend too
        assert not cpu.supports_splitting and not cpu.supports_coalescing


def test_works_are_the_backends():
    """A ``dist.*`` call returns torch's ``Work`` for the backend's own work: its methods,
    attributes and errors are the backend's."""
    rank = dist.get_rank()
    tensor = data(rank, 5, 0)
    work = dist.all_reduce(tensor, async_op=True)
    assert isinstance(work, dist.Work) and isinstance(work.py_work, MPIWork)
    assert work.wait() and work.is_completed() and work.is_success()
    assert work.exception() is None and work.kind == "allreduce"   # an MPIWork attribute
    assert torch.equal(work.result()[0], sum(everyone(5, 0)))
    assert torch.equal(work.get_future().wait()[0], sum(everyone(5, 0)))


def test_future_values_are_shaped_as_gloos():
    """A future completes with what gloo's does (``returnFutureWithOutput``): the output
    tensors of an all-gather or a root's gather as one list (it was a list of that one
    list), a barrier's ``[]`` (it was ``None``), an all-reduce's tensors."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = [torch.zeros(5, dtype=torch.int64) for _ in range(n)]
    value = dist.all_gather(out, data(rank, 5, 0), async_op=True).get_future().wait()
    assert len(value) == n and all(v is o for v, o in zip(value, out))
    assert all(torch.equal(v, data(r, 5, 0)) for r, v in enumerate(value))
    gathered = [torch.zeros(5, dtype=torch.int64) for _ in range(n)] if rank == n - 1 else None
    value = dist.gather(data(rank, 5, 1), gathered, dst=n - 1, async_op=True).get_future().wait()
    if rank == n - 1:
        assert len(value) == n and torch.equal(value[0], data(0, 5, 1))
    else:
        assert value == []
    assert dist.barrier(async_op=True).get_future().wait() == []
    tensor = data(rank, 5, 2)
    assert dist.all_reduce(tensor, async_op=True).get_future().wait()[0] is tensor


def test_get_future_result_success_and_error():
    """``get_future_result()`` completes with torch's WorkResult, never with an error
    (before: "Work::getFutureResult not implemented", as with gloo)."""
    rank = dist.get_rank()
    ok = dist.all_reduce(data(rank, 3, 0), async_op=True)
    assert ok.get_future_result().wait() == int(WorkResult.SUCCESS.value)
    if dist.get_world_size() > 1:   # a mismatch: every rank's work fails
        bad = dist.all_reduce(torch.ones(3 + rank, dtype=torch.int64), async_op=True)
        result = bad.get_future_result()
        assert result.wait() == int(WorkResult.COMM_ERROR.value)
        with pytest.raises(mpicoll.MismatchError):
            bad.wait()


def test_get_future_result_of_a_timeout():
    group = dist.new_group(list(range(dist.get_world_size())))
    release = threading.Event()
    work = backend_of(group).submit("stuck op", lambda: release.wait(60))
    result = work.get_future_result()
    with pytest.raises(CollectiveTimeoutError):
        work.wait(timedelta(seconds=0.3))
    assert result.wait() == int(WorkResult.TIMEOUT.value)
    release.set()


def test_group_timeout_and_options():
    """``timeout=`` and ``pg_options=`` of ``new_group`` reach the group, each group has
    its own copy of the options (torch's ``Backend.Options``: name, ranks, timeout), and
    ``set_timeout`` on torch's group (or gloo's ``_set_default_timeout``) changes it."""
    n = dist.get_world_size()
    mine = Options(check="first")
    group = dist.new_group(list(range(n - 1, -1, -1)), timeout=timedelta(seconds=7),
                           pg_options=mine)
    backend = backend_of(group)
    opts = backend.options
    assert isinstance(opts, C10dBackend.Options) and opts is not mine
    assert (opts.backend, opts.check, opts._timeout) == ("mpicoll", "first",
                                                         timedelta(seconds=7))
    assert opts.group_name == group.group_name
    assert opts.global_ranks_in_group == list(range(n))
    assert mine._timeout == timedelta(minutes=30)      # the caller's object is untouched
    assert backend._lane.timeout == 7.0
    group.set_timeout(timedelta(seconds=3))            # torch's ProcessGroup -> the backend
    assert backend._lane.timeout == 3.0 and opts._timeout == timedelta(seconds=3)
    backend._set_default_timeout(timedelta(seconds=4))
    assert backend._lane.timeout == 4.0
    assert backend.getBackendOptions() is opts         # c10d's Backend.getBackendOptions
    copied = copy.deepcopy(opts)                       # dist.split_group copies options
    assert copied.check == "first" and copied._timeout == timedelta(seconds=4)
    world = backend_of(None).options
    assert world._timeout == dist.default_pg_timeout and world.global_ranks_in_group == []


def test_new_group_timeout_is_the_default_wait():
    group = dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=1))
    release = threading.Event()
    work = backend_of(group).submit("stuck op", lambda: release.wait(60))
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="timed out after 1 s"):
        work.wait()
    assert 0.9 < time.monotonic() - start < 2.5
    release.set()


def test_monitored_barrier_on_torchs_group():
    """torch's ``ProcessGroup.monitored_barrier`` reaches the backend (``dist.
    monitored_barrier`` itself still accepts gloo only, by name). A group of its own:
    monitored barriers number their messages with the group's point-to-point tags, and
    test_dist_groups.py's late rank leaves one unreceived on the default group."""
    group = dist.new_group(list(range(dist.get_world_size())))
    group.monitored_barrier(timeout=timedelta(seconds=30))
    group.monitored_barrier(timeout=timedelta(seconds=30), wait_all_ranks=True)
    assert backend_of(group)._monitored == 2


def _sizes(n: int) -> list[int]:
    """Rank r's size: 0 on rank 1, else r + 2 (includes an empty block)."""
    return [0 if r == 1 else r + 2 for r in range(n)]


def test_all_gather_uneven():
    rank, n = dist.get_rank(), dist.get_world_size()
    sizes = _sizes(n)
    for rep in range(2):
        outputs = [torch.full((s,), -1, dtype=torch.int64) for s in sizes]
        dist.all_gather(outputs, data(rank, sizes[rank], rep))
        for r, got in enumerate(outputs):
            assert torch.equal(got, data(r, sizes[r], rep)), r
    # shapes may differ from the inputs' as long as the counts match
    outputs = [torch.full((1, s), -1.0) for s in sizes]
    dist.all_gather(outputs, data(rank, sizes[rank], 0, torch.float32))
    assert all(torch.equal(o.reshape(-1), data(r, sizes[r], 0, torch.float32))
               for r, o in enumerate(outputs))


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_all_gather_coalesced_uneven():
    rank, n = dist.get_rank(), dist.get_world_size()
    sizes = _sizes(n)
    outputs = [[torch.full((sizes[r],), -1, dtype=torch.int64), torch.full((3,), -1)]
               for r in range(n)]
    dist.all_gather_coalesced(outputs, [data(rank, sizes[rank], 0), data(rank, 3, 1)])
    for r in range(n):
        assert torch.equal(outputs[r][0], data(r, sizes[r], 0))
        assert torch.equal(outputs[r][1], data(r, 3, 1))


def test_all_gather_uneven_sizes_that_disagree_raise_on_every_rank():
    needs_two()
    rank, n = dist.get_rank(), dist.get_world_size()
    sizes = _sizes(n)
    if rank == 0:
        sizes[1] += 1                   # rank 0 expects one element more from rank 1
    outputs = [torch.zeros(s, dtype=torch.int64) for s in sizes]
    with pytest.raises(mpicoll.MismatchError, match="count"):
        dist.all_gather(outputs, data(rank, _sizes(n)[rank], 0))


@pytest.mark.parametrize("op", [dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.AVG],
                         ids=str)
def test_reduce_scatter_uneven(op):
    rank, n = dist.get_rank(), dist.get_world_size()
    sizes = _sizes(n)
    for rep in range(2):
        inputs = [data(rank, s, rep + d, torch.float64) for d, s in enumerate(sizes)]
        output = torch.full((sizes[rank],), -1.0, dtype=torch.float64)
        dist.reduce_scatter(output, inputs, op=op)
        mine = torch.stack([data(r, sizes[rank], rep + rank, torch.float64)
                            for r in range(n)])
        expected = {dist.ReduceOp.SUM: mine.sum(0), dist.ReduceOp.MAX: mine.max(0).values,
                    dist.ReduceOp.AVG: mine.mean(0)}[op]
        torch.testing.assert_close(output, expected, rtol=0, atol=1e-12)


def test_reduce_scatter_uneven_sizes_that_disagree_raise_on_every_rank():
    needs_two()
    rank, n = dist.get_rank(), dist.get_world_size()
    sizes = _sizes(n)
    if rank == 0:
        sizes[1] += 1
    with pytest.raises(mpicoll.MismatchError, match="count"):
        dist.reduce_scatter(torch.zeros(sizes[rank]), [torch.ones(s) for s in sizes])
    tensor = torch.ones(2)             # the group still works
    dist.all_reduce(tensor)
    assert torch.equal(tensor, torch.full((2,), float(n)))
