"""Bad input: the worker gets PSError with the reason, the server keeps serving."""
from __future__ import annotations

import numpy as np
import pytest

from mpicoll.ps import ParameterServer, PSError
from mpicoll.ps.protocol import wait_all

from ps_cases import COMM, SIZE, SMALL, expect_ps_error, make_params, need_servers, run_ps

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(90)]


@pytest.mark.parametrize("consistency", ["asp", "bsp"])
@pytest.mark.parametrize("num_servers", [1, 2])
def test_bad_pushes_rejected_by_server_others_continue(num_servers, consistency):
    need_servers(num_servers)
    params = make_params()
    ones = {k: np.ones_like(v) for k, v in params.items()}

    def worker(ps):
        if ps.worker_index == 0:
            # the server's own checks (check=False skips the local ones)
            expect_ps_error(lambda: ps.push({"nope": np.ones(3)}, check=False), "unknown key")
            expect_ps_error(lambda: ps.push({"w": np.ones((5, 37))}, check=False), "shape")
            expect_ps_error(lambda: ps.push({"w": np.ones(4)}, check=False), "elements")
            expect_ps_error(lambda: ps.push({"v": np.ones(29, dtype=np.float64)}, check=False),
                    "dtype")
            assert ps.clock == 0     # nothing was applied, so the clock did not move
            # the same caught locally, before anything is sent
            expect_ps_error(lambda: ps.push({**ones, "nope": np.ones(3)}), "unknown key 'nope'")
            expect_ps_error(lambda: ps.push({"w": ones["w"]}), "missing")
            expect_ps_error(lambda: ps.push({**ones, "b": np.ones(4)}), "shape")
            expect_ps_error(lambda: ps.push({**ones, "b": np.ones(3, np.float32)}), "dtype")
            expect_ps_error(lambda: ps.push(["not", "a", "dict"]), "dict")
            expect_ps_error(lambda: ps.pull({"w": np.ones(3)}), "shape")
        for _ in range(3):   # every worker, the rejected one included, still trains
            ps.push(ones)
            ps.pull()
        wait_all([ps.worker_comm.Ibarrier()])
        return ps.pull(), ps.stats()

    _, res = run_ps(params, worker, num_servers, consistency=consistency, lr=0.5,
                    average=False, **SMALL)
    if isinstance(res, tuple):
        final, stats = res
        nworkers = SIZE - num_servers
        for k in params:
            want = params[k].copy()
            if consistency == "asp":
                for _ in range(3 * nworkers):     # each push is one update of lr * 1
                    want -= 0.5 * np.ones_like(want)
            else:
                for _ in range(3):                # each round: lr * (sum of the pushes)
                    want -= 0.5 * np.full_like(want, nworkers)
            np.testing.assert_array_equal(final[k], want)
        assert sum(s["errors"] for s in stats["servers"]) >= 4


@pytest.mark.parametrize("consistency", ["asp", "bsp"])
@pytest.mark.parametrize("num_servers", [1, 2])
def test_partly_rejected_push_refuses_later_calls(num_servers, consistency):
    """push(check=False) with one tensor of the wrong shape: the other tensors' shards
    accept it, the bad one's refuse it, so the servers' clocks for this worker are out of
    step (no later push could be accepted everywhere). The push raises with the server's
    reason; every later push and pull raises a PSError saying so and sends nothing (no
    partial update, no pull waiting forever for a round that cannot close); close()
    still works; another worker then pulls what the servers hold."""
    need_servers(num_servers)
    params = make_params()
    ones = {k: np.ones_like(v) for k, v in params.items()}

    def worker(ps):
        if ps.worker_index == 0:
            try:
                expect_ps_error(lambda: ps.push({**ones, "w": ones["w"].reshape(5, 37)},
                                                check=False), "shape", "out of step")
                for call in (lambda: ps.push(ones), ps.pull, lambda: ps.push_pull(ones)):
                    expect_ps_error(call, "out of step")
            finally:
                wait_all([ps.worker_comm.Ibarrier()])
            return None
        wait_all([ps.worker_comm.Ibarrier()])
        return ps.pull() if ps.worker_index == 1 else None

    _, res = run_ps(params, worker, num_servers, consistency=consistency, lr=0.5,
                    average=False, **SMALL)
    if res is not None and "w" in res:
        # asp applied the first push's accepted shards once (bsp: its round is still
        # open), later pushes nothing
        moved = 0.5 if consistency == "asp" else 0.0
        for k, v in res.items():
            want = params[k] if k == "w" else params[k] - np.asarray(moved, params[k].dtype)
            np.testing.assert_array_equal(v, want, err_msg=k)


@pytest.mark.parametrize("num_servers", [1, 2])
def test_push_before_init_and_duplicate_init(num_servers):
    need_servers(num_servers)
    params = make_params()
    ones = {k: np.ones_like(v) for k, v in params.items()}

    def worker(ps):
        if ps.worker_index == 0:
            expect_ps_error(lambda: ps.push(ones), "not initialized", "push before init")
            expect_ps_error(lambda: ps.pull(), "not initialized")
            ps.init(params)
            expect_ps_error(lambda: ps.init(params), "duplicate init")
        wait_all([ps.worker_comm.Ibarrier()])
        w = ps.push_pull(ones)
        return w

    _, w = run_ps(None if COMM.Get_rank() < num_servers else params, worker, num_servers,
                  init=False, lr=0.25, **SMALL)
    if w is not None and "server" not in w:
        for k in params:
            np.testing.assert_array_equal(w[k], params[k] - 0.25)


def test_constructor_errors_raised_on_every_rank():
    need_servers(1)
    params = make_params()
    with pytest.raises(ValueError, match="num_servers"):
        ParameterServer(params, comm=COMM, num_servers=SIZE)
    with pytest.raises(ValueError, match="consistency"):
        ParameterServer(params, comm=COMM, consistency="eventual")
    with pytest.raises(ValueError, match="unknown hyperparameter"):
        ParameterServer(params, comm=COMM, learning_rate=0.1)
    with pytest.raises(ValueError, match="needs consistency='bsp'"):
        ParameterServer(params, comm=COMM, optimizer="sum", consistency="asp")
    # one rank alone passes a bad value: every rank raises
    with pytest.raises(ValueError, match=f"rank {SIZE - 1}"):
        ParameterServer(params, comm=COMM, staleness=-1 if COMM.Get_rank() == SIZE - 1 else 0)
    # ranks disagree: PSError everywhere
    with pytest.raises(PSError, match="other settings"):
        ParameterServer(params, comm=COMM, lr=0.1 if COMM.Get_rank() == 0 else 0.2)
    if SIZE >= 3:
        mine = dict(params)
        if COMM.Get_rank() == SIZE - 1:
            mine["b"] = np.zeros(4)
        with pytest.raises(PSError, match="differ"):
            ParameterServer(mine, comm=COMM)


class _Unreadable:
    """Claims a shape and dtype, but numpy cannot read it (like a tensor on a device)."""

    shape = (3,)
    dtype = np.dtype(np.float64)

    def __array__(self, *args, **kwargs):
        raise RuntimeError("the values live elsewhere")


@pytest.mark.parametrize("num_servers", [1, "colocated"])
def test_unreadable_initial_values_fail_on_every_rank(num_servers):
    """The rank whose values initialize the servers reads them at set-up: a value it
    cannot send raises ValueError everywhere instead of leaving the servers waiting."""
    need_servers(1)
    first = 0 if num_servers == "colocated" else num_servers
    params = make_params()
    if COMM.Get_rank() == first:
        params["b"] = _Unreadable()
    with pytest.raises(ValueError, match=rf"rank {first}: .*params\['b'\] cannot be read"):
        ParameterServer(params, comm=COMM, num_servers=num_servers)
    # nothing was left pending: the next constructor, with readable values, works
    params["b"] = make_params()["b"]
    run_ps(params, lambda ps: ps.pull(), num_servers)


def test_role_errors():
    need_servers(1)
    params = make_params()

    def worker(ps):
        expect_ps_error(ps.serve, "is a worker")
        return ps.pull()

    ps, _ = run_ps(params, worker, 1)
    if ps.is_server:
        expect_ps_error(ps.pull, "is a server")
        expect_ps_error(lambda: ps.save("x"), "is a server")


def test_stats_report_placement():
    need_servers(1)
    k = 2 if SIZE >= 3 else 1
    params = make_params()

    def worker(ps):
        ps.push_pull({n: np.ones_like(v) for n, v in params.items()})
        return ps.stats()

    _, stats = run_ps(params, worker, k, **SMALL)
    total = sum(v.nbytes for v in params.values())
    assert sum(stats["bytes_per_server"]) == total
    assert len(stats["bytes_per_server"]) == k
    if "servers" in stats:
        assert [s["server"] for s in stats["servers"]] == list(range(k))
        assert sum(s["bytes_stored"] for s in stats["servers"]) == total
        assert stats["worker"]["pushes"] == 1 and stats["worker"]["clock"] == 1
