"""The constructor is collective and returns on every rank by itself.

Between ``ParameterServer(...)`` and ``serve()`` every rank makes collective calls of its
own on the user's communicator (``comm.allgather(ps.is_server)`` to log the layout and a
``comm.Barrier()``), in every layout (1 server, 2 servers with whole tensors, 2 servers
with split tensors, co-located), fresh, with ``init=False`` and restored from a
checkpoint. Before the constructor was collective, workers waited inside it for the
servers to enter ``serve()``, so these calls deadlocked.

A regression must fail within seconds, not hang: :func:`_collectives_before_serve` first
makes a non-blocking barrier with a deadline; a server that misses it reports the failure
and serves anyway, so the stuck workers' constructors complete and every rank reaches the
collective verdict.
"""
from __future__ import annotations


import numpy as np
import pytest

from mpicoll.ps import COLOCATED, ParameterServer
from mpicoll.ps.protocol import wait_all

from ps_cases import (wait_request, COMM, RANK, SIZE, SMALL, assert_params_equal, make_grads, make_params,
                      need_servers, remove_shared, run_ps, shared_tmpdir)

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]

#: seconds the constructor may take on the slowest rank (it takes milliseconds)
DEADLINE = 10.0

#: (num_servers, extra arguments): one server, two with whole tensors (default split
#: threshold), two with every large tensor split over both (sharded), co-located
LAYOUTS = {"1-server": (1, SMALL),
           "2-servers": (2, dict(chunk_bytes=96)),
           "2-servers-sharded": (2, SMALL),
           "colocated": (COLOCATED, SMALL)}

HYPER = dict(optimizer="momentum", lr=0.25, momentum=0.5)


def _bounded_barrier(deadline: float) -> bool:
    """A barrier over COMM; False if it did not complete within ``deadline`` seconds."""
    req = COMM.Ibarrier()
    return wait_request(req, deadline)


def _collectives_before_serve(ps: ParameterServer) -> None:
    """What a user does between construction and serve(): allgather the roles, barrier.

    Raises AssertionError on every rank if the constructor did not return on every rank
    in time; the servers have then already served (so that every worker's constructor
    could return and the workers' close() lets them go), and must not serve again.
    """
    in_time = _bounded_barrier(DEADLINE)
    late = np.array([0 if in_time else 1], dtype=np.int64)
    verdict = np.zeros(1, dtype=np.int64)
    req = COMM.Iallreduce(late, verdict)
    if not in_time and ps.is_server:
        ps.serve()          # rescue: let the workers' constructors finish, then fail
    wait_all([req])
    assert not verdict[0], (f"the constructor did not return on every rank within "
                            f"{DEADLINE} s: a collective between ParameterServer(...) and "
                            f"serve() would deadlock")
    roles = COMM.allgather(ps.is_server)
    COMM.Barrier()
    want_servers = 0 if ps.colocated else ps.num_servers
    assert roles == [r < want_servers for r in range(SIZE)], roles


def _build_then_collectives(params, num_servers, worker_fn, **kwargs):
    """run_ps with the collectives between construction and serve(); worker_fn's result."""
    return run_ps(params, worker_fn, num_servers, between=_collectives_before_serve,
                  **kwargs)[1]


def _expected_after_one_step(start: dict, num_workers: int) -> dict:
    """sgd with momentum from zero velocity: one bsp round of every worker's gradient."""
    out = {}
    for name, p in start.items():
        acc = make_grads(start, 0, 7)[name].copy()
        for w in range(1, num_workers):
            acc += make_grads(start, w, 7)[name]
        if num_workers > 1:
            np.divide(acc, num_workers, out=acc)
        out[name] = p - HYPER["lr"] * acc
    return out


def _check_values_then_step(start: dict):
    """A worker: the servers hold ``start``; one push_pull gives the expected step."""
    def worker(ps):
        assert_params_equal(ps.pull(), start, "values after construction:")
        got = ps.push_pull(make_grads(start, ps.worker_index, 7))
        want = _expected_after_one_step(start, ps.num_workers)
        for name in start:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, err_msg=name)
        return got
    return worker


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_collectives_between_constructor_and_serve(layout):
    num_servers, extra = LAYOUTS[layout]
    need_servers(num_servers)
    params = make_params()
    _build_then_collectives(params, num_servers, _check_values_then_step(params),
                            **HYPER, **extra)


@pytest.mark.parametrize("layout", sorted(k for k in LAYOUTS if k != "colocated"))
def test_collectives_with_init_false(layout):
    num_servers, extra = LAYOUTS[layout]
    need_servers(num_servers)
    params = make_params()

    def worker(ps):
        if ps.worker_index == 0:
            ps.init(params)
        wait_all([ps.worker_comm.Ibarrier()])
        return _check_values_then_step(params)(ps)

    _build_then_collectives(params, num_servers, worker, init=False, **HYPER, **extra)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_collectives_after_restore(layout):
    num_servers, extra = LAYOUTS[layout]
    need_servers(num_servers)
    params = make_params()
    path = shared_tmpdir()
    try:
        def train_and_save(ps):
            for t in range(2):
                ps.push_pull(make_grads(params, ps.worker_index, t))
            ps.save(path)
            return ps.pull()

        _, saved = run_ps(params, train_and_save, num_servers, **HYPER, **extra)
        # every rank learns the saved values (servers have none of their own)
        first = 0 if num_servers == COLOCATED else num_servers
        saved = COMM.bcast(saved if RANK == first else None, root=first)

        def worker(ps):
            assert ps.clock == 2
            assert_params_equal(ps.pull(), saved, "values after restore:")

        _build_then_collectives(params, num_servers, worker, restore=path, **HYPER, **extra)
    finally:
        remove_shared(path)
