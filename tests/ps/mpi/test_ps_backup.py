"""BSP with backup workers: rounds close without the slowest worker, late pushes dropped.

The straggler here is made slow deterministically, not by timing: the last worker waits
for a message from the first one, sent once the others have finished ``K`` rounds without
it. Every assertion is on values and counters, never on speed; a server that ignored
``backup_workers`` would leave the others waiting at round 0 until the straggler gives up
waiting (``DEADLINE``), and the counters and clocks checked below would then be wrong.
"""
from __future__ import annotations


import numpy as np
import pytest
from mpi4py import MPI

from mpicoll.ps import ParameterServer

from ps_cases import (wait_request, COMM, SIZE, SMALL, assert_params_equal, make_grads, make_params,
                      need_servers, reference_bsp, run_ps, sgd_update)

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(90)]

K = 3             #: rounds the fast workers complete before the straggler pushes
DEADLINE = 10.0   #: seconds the straggler waits for the others before giving up
TAG_GO = 77
LR = 0.25


def _layouts() -> list[int]:
    """Server counts that leave at least two workers at this world size."""
    return [k for k in (1, 2) if SIZE - k >= 2]


def _poll(req: MPI.Request, deadline: float = DEADLINE) -> bool:
    return wait_request(req, deadline)


def _workers_meet(ps: ParameterServer) -> None:
    """A barrier of the workers that polls (a blocking one would spin on the cores)."""
    assert _poll(ps.worker_comm.Ibarrier(), 3 * DEADLINE), "workers did not meet"


def _fast_reference(params: dict, fast: int, rounds: int) -> list[dict]:
    """Parameters after each of ``rounds`` sgd rounds averaging workers ``0..fast-1``."""
    grads = [[make_grads(params, w, t) for w in range(fast)] for t in range(rounds)]
    return reference_bsp(params, grads, sgd_update(LR))


def _straggler_waits(ps: ParameterServer) -> bool:
    """The last worker: wait until the first one says the others finished K rounds."""
    go = np.zeros(1, np.int64)
    req = ps.worker_comm.Irecv([go, MPI.INT64_T], 0, TAG_GO)
    if _poll(req):
        return True
    req.Cancel()
    req.Wait()
    return False


def _tell_straggler(ps: ParameterServer) -> None:
    if ps.worker_index == 0:
        ps.worker_comm.Send([np.ones(1, np.int64), MPI.INT64_T], ps.num_workers - 1, TAG_GO)


@pytest.mark.parametrize("bad,fragment", [
    (-1, "must be an int >= 0"), (True, "must be an int >= 0"),
    ("workers", "must be less than the number of workers"),
    (1.5, "must be an int >= 0")])
def test_bad_backup_workers_fail_on_every_rank(bad, fragment):
    for k in [k for k in (1, 2) if k < SIZE]:
        b = SIZE - k if bad == "workers" else bad
        with pytest.raises(ValueError, match=fragment):
            ParameterServer(make_params(), comm=COMM, num_servers=k, backup_workers=b)


@pytest.mark.parametrize("kw,fragment", [
    (dict(num_servers="colocated"), "needs separate servers"),
    (dict(consistency="asp"), "needs consistency='bsp'"),
    (dict(consistency="ssp", staleness=1), "needs consistency='bsp'"),
    (dict(optimizer="sum"), "not optimizer='sum'")])
def test_backup_workers_refused_where_undefined(kw, fragment):
    if SIZE < 3 and kw.get("num_servers") != "colocated":
        pytest.skip("needs two workers")
    kw = {"num_servers": 1, **kw}
    with pytest.raises(ValueError, match=fragment):
        ParameterServer(make_params(), comm=COMM, backup_workers=1, **kw)


@pytest.mark.parametrize("num_servers", [1, 2])
def test_rounds_close_without_the_straggler(num_servers):
    """b=1: the fast workers finish K rounds alone; the straggler's push for round 0 is
    dropped on every shard, its pull returns round K's parameters and moves its clock to K;
    then one round with everybody completes."""
    if num_servers not in _layouts():
        pytest.skip("needs two workers")
    params = make_params()
    fast = SIZE - num_servers - 1
    history = _fast_reference(params, fast, K)

    def worker(ps):
        straggler = ps.worker_index == ps.num_workers - 1
        if straggler:
            waited = _straggler_waits(ps)
            got = ps.push_pull(make_grads(params, ps.worker_index, 0))
            mine = (waited, got, ps.clock, ps.stats())
        else:
            for t in range(K):
                ps.push_pull(make_grads(params, ps.worker_index, t))
            _tell_straggler(ps)
            mine = None
        _workers_meet(ps)
        stats = ps.stats()   # every worker, after the straggler's late push
        _workers_meet(ps)    # (before anybody pushes round K)
        after = ps.push_pull(make_grads(params, ps.worker_index, K))
        return mine, stats, after, ps.clock, ps.worker_comm.allgather(after)

    _, res = run_ps(params, worker, num_servers, backup_workers=1, optimizer="sgd", lr=LR,
                    **SMALL)
    if COMM.Get_rank() < num_servers:
        return
    mine, stats, after, clock, everyone = res
    shards = sum(s["shards"] for s in stats["servers"])
    assert sum(s["late_pushes_dropped"] for s in stats["servers"]) == shards, stats
    assert sum(s["short_rounds"] for s in stats["servers"]) == K * shards, stats
    assert sum(s["updates"] for s in stats["servers"]) == K * shards, stats
    if mine is not None:
        waited, got, straggler_clock, own = mine
        assert waited, "the others did not finish their rounds without the straggler"
        assert straggler_clock == K
        assert own["worker"]["late_pushes_dropped"] == shards
        assert_params_equal(got, history[K - 1], "straggler's pull after its dropped push:")
    assert clock == K + 1
    for other in everyone:      # round K closed without at most one push; all see it
        assert_params_equal(other, after, "after the round everybody pushed:")



@pytest.mark.parametrize("num_servers", [1, 2])
def test_backups_without_a_straggler_still_train(num_servers):
    if num_servers not in _layouts():
        pytest.skip("needs two workers")
    params = make_params()
    rounds = 5

    def worker(ps):
        steps = 0
        while ps.clock < rounds:
            ps.push_pull(make_grads(params, ps.worker_index, ps.clock))
            steps += 1
        _workers_meet(ps)
        final = ps.pull()
        return steps, ps.clock, final, ps.worker_comm.allgather(final), ps.stats()

    _, res = run_ps(params, worker, num_servers, backup_workers=1, optimizer="sgd", lr=LR,
                    **SMALL)
    if COMM.Get_rank() < num_servers:
        return
    steps, clock, final, everyone, stats = res
    assert clock == rounds and 1 <= steps <= rounds
    shards = sum(s["shards"] for s in stats["servers"])
    assert sum(s["updates"] for s in stats["servers"]) == rounds * shards
    for other in everyone:
        assert_params_equal(other, final, "every worker's final pull:")
    assert not np.array_equal(final["w"], params["w"]) and np.isfinite(final["w"]).all()


@pytest.mark.parametrize("num_servers", [1, 2])
def test_shutdown_with_a_late_push_in_flight(num_servers):
    """The fast workers close while the straggler's late push is still to come; the
    straggler then trains on alone (a round of one push) and closes with a push in flight."""
    if num_servers not in _layouts():
        pytest.skip("needs two workers")
    params = make_params()
    fast = SIZE - num_servers - 1
    history = _fast_reference(params, fast, K)
    alone = reference_bsp(history[-1], [[make_grads(params, fast, K)]], sgd_update(LR))

    def worker(ps):
        if ps.worker_index < ps.num_workers - 1:
            for t in range(K):
                ps.push_pull(make_grads(params, ps.worker_index, t))
            _tell_straggler(ps)
            return None
        waited = _straggler_waits(ps)
        late = ps.push_pull(make_grads(params, ps.worker_index, 0))    # dropped
        nxt = ps.push_pull(make_grads(params, ps.worker_index, ps.clock))
        ps.push_async(make_grads(params, ps.worker_index, ps.clock))   # left in flight
        return waited, late, nxt

    _, res = run_ps(params, worker, num_servers, backup_workers=1, optimizer="sgd", lr=LR,
                    **SMALL)
    if res is not None and COMM.Get_rank() >= num_servers:
        waited, late, nxt = res
        assert waited
        assert_params_equal(late, history[-1], "straggler's pull:")
        assert_params_equal(nxt, alone[0], "the straggler's round alone:")
