"""Asynchronous operations and errors of the "mpicoll" backend: calls return before the
communication is done, complete in call order per group, and raise at ``wait()`` and
through their futures; bad or mismatched arguments raise on every rank (no hang).
"""
from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from test_dist_collectives import GATHER_INTO, data, everyone

import mpicoll
from mpicoll.errors import CollectiveTimeoutError
from mpicoll.runtime import failures
from mpicoll.torch.distributed import backend_of

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


def test_a_callback_waits_for_an_operation_queued_after_it():
    """A future callback that waits for an operation already queued behind the one it
    follows (torch's ZeRO overlap does so) gets it: the group's thread runs the queued
    operations in order from the wait (it blocked there until the group's timeout)."""
    rank = dist.get_rank()
    first, second, third = data(rank, 3, 0), data(rank, 4, 1), data(rank, 5, 2)
    work_a = dist.all_reduce(first, async_op=True)
    work_b = dist.all_reduce(second, async_op=True)
    work_c = dist.all_reduce(third, async_op=True)

    def then(fut):
        work_b.wait(timeout=timedelta(seconds=30))
        return second.clone()

    start = time.monotonic()
    out = work_a.get_future().then(then).wait()
    work_c.wait()
    assert time.monotonic() - start < 20
    assert torch.equal(out, sum(everyone(4, 1)))
    assert torch.equal(first, sum(everyone(3, 0)))
    assert torch.equal(third, sum(everyone(5, 2)))


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


def _stuck(group):
    """A group's operation that runs until released (every rank's own, no MPI), and the
    event that releases it."""
    import threading

    release = threading.Event()
    return backend_of(group).submit("stuck op", lambda: release.wait(60)), release


def _finish(group, release) -> None:
    """Let the stuck operation end (a broken group is then destroyed cleanly): once
    released, it returns at once, or never runs (aborted while still queued)."""
    release.set()
    lane = backend_of(group)._lane
    for _ in range(1000):
        if lane._running is None and lane._queue.empty():
            return
        time.sleep(0.01)


def _fresh_group():
    return dist.new_group(list(range(dist.get_world_size())))


def test_wait_timeout_raises_at_once_and_breaks_the_group():
    """``Work.wait(timeout)`` raises CollectiveTimeoutError (a RuntimeError) naming the
    operation as the timeout passes; the group is broken: the work queued behind fails
    with the same error (without ULFM, using the group again would end the job: the
    serial test_torch_dist_startup_exit.py runs that)."""
    group = _fresh_group()
    work, release = _stuck(group)
    queued = dist.all_reduce(torch.ones(2), group=group, async_op=True)
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="stuck op .*timed out after 1 s") as info:
        work.wait(timedelta(seconds=1))
    assert 0.9 < time.monotonic() - start < 1.5
    assert isinstance(info.value, RuntimeError) and info.value.operation == "stuck op"
    with pytest.raises(CollectiveTimeoutError):
        queued.wait()
    assert backend_of(group)._lane.broken is info.value
    _finish(group, release)


def test_set_timeout_is_the_default_wait():
    group = _fresh_group()
    group.set_timeout(timedelta(seconds=0.5))
    work, release = _stuck(group)
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="timed out after 0.5 s"):
        work.wait()
    assert 0.4 < time.monotonic() - start < 1.2
    _finish(group, release)


def test_abort_fails_the_work_in_flight_and_the_queued_work():
    group = _fresh_group()
    work, release = _stuck(group)
    queued = [dist.all_reduce(torch.ones(2), group=group, async_op=True),
              dist.barrier(group=group, async_op=True)]
    if dist.get_world_size() > 1:   # a receive nobody sends: in flight too
        queued.append(dist.irecv(torch.zeros(1), group=group, group_src=1 - min(
            dist.get_rank(), 1), tag=99))
    futures = [w.get_future() for w in [work] + queued]
    start = time.monotonic()
    group.abort()
    # this rank's abort, or (under ULFM) a peer's that revoked the group a moment before
    aborted = "was aborted|another rank revoked the communicator"
    for w in [work] + queued:
        with pytest.raises(mpicoll.CollectiveError, match=aborted):
            w.wait()
        assert w.is_completed() and not w.is_success()
    for fut in futures:
        with pytest.raises(mpicoll.CollectiveError, match=aborted):
            fut.wait()
    assert time.monotonic() - start < 1.0
    if dist.get_world_size() > 1 and not failures.ENABLED:
        queued[-1]._request.Cancel()   # the receive nobody sends (ULFM: revoked, ended)
    _finish(group, release)


def _aborted_by_rank_0():
    """Under ULFM (else skipped) at n >= 2: a new group, which rank 0 aborts at once
    (``None`` there)."""
    if not failures.ENABLED or dist.get_world_size() < 2:
        pytest.skip("needs ULFM and two ranks")
    group = _fresh_group()
    if dist.get_rank() == 0:
        group.abort()
        return None
    return group


def test_a_peers_abort_fails_a_posted_receive_with_a_collective_error():
    """Under ULFM, rank 0 aborts the group while the other ranks have a receive posted
    from it and have not aborted: the receive ends with a CollectiveError saying another
    rank revoked the communicator (MPI's raw MPI_ERR_REVOKED before; seen once in CI
    when a peer's abort overtook this rank's own in the test above)."""
    group = _aborted_by_rank_0()
    if group is None:
        return
    work = dist.irecv(torch.zeros(1), group=group, group_src=0, tag=98)
    with pytest.raises(mpicoll.CollectiveError, match="another rank revoked"):
        work.wait(timedelta(seconds=20))
    backend_of(group).abort()


def test_a_peers_abort_fails_every_queued_work_at_once():
    """Under ULFM, rank 0 aborts the group while the other ranks have 20 all-reduces
    queued on it: the first meets the revocation, and the lane breaks with that error, so
    all 20 fail within seconds (each waited the runtime's second for a process failure
    before: one per second, and a rank that went on meanwhile timed out on another
    group)."""
    group = _aborted_by_rank_0()
    if group is None:
        return
    works = [dist.all_reduce(torch.ones(50_000), group=group, async_op=True)
             for _ in range(20)]
    start = time.monotonic()
    for w in works:
        with pytest.raises(mpicoll.CollectiveError, match="another rank revoked"):
            w.wait(timedelta(seconds=60))
    assert time.monotonic() - start < 8, f"{time.monotonic() - start:.1f} s"
    backend_of(group).abort()


def test_shrink_with_the_abort_flag_fails_the_work_in_flight():
    """``Backend.shrink(ranks_to_exclude, shrink_flags=SHRINK_ABORT)`` (torch's
    ``dist.shrink_group``'s call): the old group's work in flight and queued fails with
    "was aborted" before the new group of the other members is made; the new group
    reduces over them (its global ranks: the old group's but the last)."""
    needs_two()
    rank, n = dist.get_rank(), dist.get_world_size()
    group = _fresh_group()
    if rank == n - 1:            # excluded: makes no call (the shrink is the others')
        dist.destroy_process_group(group)
        return
    work, release = _stuck(group)
    queued = dist.all_reduce(torch.ones(2), group=group, async_op=True)
    new = backend_of(group).shrink([n - 1], shrink_flags=1)
    for w in (work, queued):
        with pytest.raises(mpicoll.CollectiveError, match="was aborted"):
            w.wait()
    _finish(group, release)
    assert (new.rank(), new.size()) == (rank, n - 1)
    assert new.options.global_ranks_in_group == list(range(n - 1))
    tensor = data(rank, 5, 1)
    new.allreduce([tensor], dist.AllreduceOptions()).wait()
    assert torch.equal(tensor, sum(everyone(5, 1)[:n - 1]))
    new.shutdown()
    dist.destroy_process_group(group)


def test_shutdown_finishes_queued_work_and_frees_the_communicators():
    from mpicoll.runtime import comms

    rank, n = dist.get_rank(), dist.get_world_size()
    group = _fresh_group()
    tensors = [torch.full((3,), rank + i) for i in range(5)]
    works = [dist.all_reduce(t, group=group, async_op=True) for t in tensors]
    backend = backend_of(group)
    assert {r.owner for r in map(comms.record_of, (backend.comm, backend._p2p))} == {"group"}
    start = time.monotonic()
    dist.destroy_process_group(group)
    assert time.monotonic() - start < 10
    assert all(w.is_completed() for w in works)
    assert torch.equal(tensors[-1], torch.full((3,), sum(r + 4 for r in range(n))))
    assert comms.record_of(backend.comm) is None and comms.record_of(backend._p2p) is None
