"""BSP/ASP/SSP semantics and optimizers against single-process numpy references."""
from __future__ import annotations

import time

import numpy as np
import pytest

from ps_cases import (COMM, SMALL, adam_update, assert_params_equal,
                      make_grads, make_params, momentum_update, need_servers, reference_bsp,
                      run_ps, sgd_update)

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(90)]

STEPS = 4


def _bsp_run(num_servers: int, optimizer: str, update, **kw):
    params = make_params()
    nworkers = COMM.Get_size() - num_servers
    grads = [[make_grads(params, w, t) for w in range(nworkers)] for t in range(STEPS)]
    history = reference_bsp(params, grads, update)

    def worker(ps):
        seen = [ps.pull()]
        for t in range(STEPS):
            g = grads[t][ps.worker_index]
            if t % 2:   # both ways of stepping
                ps.push(g)
                seen.append(ps.pull())
            else:
                seen.append(ps.push_pull(g))
        return seen

    _, seen = run_ps(params, worker, num_servers, consistency="bsp", optimizer=optimizer,
                     **SMALL, **kw)
    if seen is not None and not isinstance(seen, dict):
        assert_params_equal(seen[0], params, "initial pull")
        for t in range(STEPS):
            assert_params_equal(seen[t + 1], history[t], f"after step {t + 1}:")


@pytest.mark.parametrize("num_servers", [1, 2])
def test_bsp_sgd_equals_reference(num_servers):
    need_servers(num_servers)
    _bsp_run(num_servers, "sgd", sgd_update(0.125), lr=0.125)


@pytest.mark.parametrize("num_servers", [1, 2])
def test_bsp_momentum_equals_reference(num_servers):
    need_servers(num_servers)
    _bsp_run(num_servers, "momentum", momentum_update(0.1, 0.8), lr=0.1, momentum=0.8)


@pytest.mark.parametrize("num_servers", [1, 2])
def test_bsp_adam_equals_reference(num_servers):
    need_servers(num_servers)
    _bsp_run(num_servers, "adam", adam_update(0.01, 0.9, 0.99, 1e-6), lr=0.01, beta1=0.9,
             beta2=0.99, eps=1e-6)


@pytest.mark.parametrize("num_servers", [1, 2])
def test_bsp_sum_returns_round_aggregate(num_servers):
    need_servers(num_servers)
    params = {"g": np.zeros(41, dtype=np.int64), "h": np.zeros((3, 3), dtype=np.float32)}
    nworkers = COMM.Get_size() - num_servers

    def grads(w, t):
        return {"g": np.arange(41, dtype=np.int64) * (w + 1) + t,
                "h": np.full((3, 3), w + 0.5 * t, dtype=np.float32)}

    def worker(ps):
        out = []
        for t in range(3):
            out.append(ps.push_pull(grads(ps.worker_index, t)))
        return out

    _, seen = run_ps(params, worker, num_servers, optimizer="sum", **SMALL)
    if isinstance(seen, list):
        for t in range(3):
            want = {k: sum(grads(w, t)[k] for w in range(nworkers)) for k in params}
            assert_params_equal(seen[t], {k: v.astype(params[k].dtype) for k, v in want.items()})


@pytest.mark.parametrize("num_servers", [1, 2])
def test_asp_applies_every_push(num_servers):
    """Integer-valued float gradients: the final value is exact in any arrival order."""
    need_servers(num_servers)
    params = {"w": np.zeros(50, dtype=np.float64), "s": np.ones(3, dtype=np.float32)}
    nworkers = COMM.Get_size() - num_servers
    steps = 5

    def grads(w, t):
        return {"w": np.arange(50, dtype=np.float64) + w * 10 + t,
                "s": np.full(3, w - t, dtype=np.float32)}

    def worker(ps):
        for t in range(steps):
            ps.push(grads(ps.worker_index, t))
            ps.pull()
        from mpicoll.ps.protocol import wait_all
        wait_all([ps.worker_comm.Ibarrier()])
        return ps.pull(), ps.stats()

    _, res = run_ps(params, worker, num_servers, consistency="asp", optimizer="sgd",
                    lr=0.5, average=False, **SMALL)
    if isinstance(res, tuple):
        final, stats = res
        want = {k: params[k] - 0.5 * sum(grads(w, t)[k] for w in range(nworkers)
                                         for t in range(steps)) for k in params}
        assert_params_equal(final, {k: v.astype(params[k].dtype) for k, v in want.items()})
        assert sum(s["pushes"] for s in stats["servers"]) >= nworkers * steps


@pytest.mark.parametrize("num_servers", [1, 2])
@pytest.mark.parametrize("bound", [0, 1, 3])
def test_ssp_staleness_never_exceeds_bound(num_servers, bound):
    need_servers(num_servers)
    params = {"w": np.zeros(20, dtype=np.float32), "b": np.zeros(2, dtype=np.float32)}

    def worker(ps):
        for t in range(8):
            if ps.worker_index == 0:
                time.sleep(0.004)     # a straggler, so faster workers run ahead
            ps.push_pull({"w": np.ones(20, np.float32), "b": np.ones(2, np.float32)})
        return ps.stats()

    _, stats = run_ps(params, worker, num_servers, consistency="ssp", staleness=bound,
                      lr=0.1, **SMALL)
    if "server" in stats:
        assert stats["server"]["staleness_max"] <= bound
        assert stats["server"]["staleness_count"] > 0
    else:
        assert stats["worker"]["staleness_max"] <= bound
        for s in stats["servers"]:
            assert s["staleness_max"] <= bound


def test_ssp_pull_waits_for_the_slowest():
    """A worker s+1 clocks ahead of another is not answered until that one pushes."""
    need_servers(1)
    if COMM.Get_size() - 1 < 2:
        pytest.skip("needs two workers")
    bound = 1
    params = {"w": np.zeros(4, dtype=np.float32)}
    one = {"w": np.ones(4, dtype=np.float32)}
    from mpicoll.ps.protocol import wait_all

    def worker(ps):
        answered_early = None
        if ps.worker_index == 0:
            for _ in range(bound + 1):
                ps.push(one)
            h = ps.pull_async()
            time.sleep(0.3)
            answered_early = h.test()
            ps.worker_comm.bcast("go", root=0)
            h.wait()
        else:
            ps.worker_comm.bcast(None, root=0)
            ps.push(one)
        wait_all([ps.worker_comm.Ibarrier()])
        return answered_early, ps.stats()

    _, res = run_ps(params, worker, 1, consistency="ssp", staleness=bound, lr=1.0)
    if isinstance(res, tuple):
        answered_early, stats = res
        assert answered_early in (None, False), "pull answered while a worker lagged > s"
        assert all(s["staleness_max"] <= bound for s in stats["servers"])


@pytest.mark.parametrize("consistency", ["bsp", "ssp", "asp"])
@pytest.mark.parametrize("num_servers", [1, 2])
def test_early_finish_does_not_block_others(num_servers, consistency):
    """Worker i runs 2 + i steps; the rest go on after a worker closes."""
    need_servers(num_servers)
    params = make_params()
    nworkers = COMM.Get_size() - num_servers
    steps = [2 + w for w in range(nworkers)]
    grads = [[make_grads(params, w, t) for w in range(nworkers) if steps[w] > t]
             for t in range(max(steps))]

    def worker(ps):
        w = None
        for t in range(steps[ps.worker_index]):
            w = ps.push_pull(make_grads(params, ps.worker_index, t))
        return w

    _, final = run_ps(params, worker, num_servers, consistency=consistency, staleness=1,
                      lr=0.125, **SMALL)
    if consistency == "bsp" and final is not None and "server" not in final:
        history = reference_bsp(params, grads, sgd_update(0.125))
        mine = steps[COMM.Get_rank() - num_servers]
        assert_params_equal(final, history[mine - 1], f"worker after {mine} steps:")
