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
            # the server's own checks (check=False skips the local ones of shapes and
            # dtypes, not of names): every tensor bad, so every shard rejects the push
            other = {np.dtype(np.float64): np.float32, np.dtype(np.float32): np.float64}
            for bad, reason in (({k: v.reshape(-1, 1) for k, v in ones.items()}, "shape"),
                                ({k: np.ones(4, v.dtype) for k, v in ones.items()},
                                 "elements"),
                                ({k: v.astype(other[v.dtype]) for k, v in ones.items()},
                                 "dtype")):
                expect_ps_error(lambda bad=bad: ps.push(bad, check=False), reason)
            assert ps.clock == 0     # nothing was applied, so the clock did not move
            # the same caught locally, before anything is sent
            expect_ps_error(lambda: ps.push({**ones, "nope": np.ones(3)}), "unknown key 'nope'")
            expect_ps_error(lambda: ps.push({"w": ones["w"]}), "missing")
            expect_ps_error(lambda: ps.push({**ones, "b": np.ones(4)}), "shape")
            expect_ps_error(lambda: ps.push({**ones, "b": np.ones(3, np.float32)}), "dtype")
            expect_ps_error(lambda: ps.push(["not", "a", "dict"]), "dict")
            expect_ps_error(lambda: ps.pull({"w": np.ones(3)}), "shape")
            # a misspelt out name: an error, not a buffer left as it was
            expect_ps_error(lambda: ps.pull({"ww": np.ones(3)}), "unknown keys ['ww']")
            expect_ps_error(lambda: ps.push_pull(ones, out={"ww": np.ones(3)}),
                            "unknown keys ['ww']")
            expect_ps_error(lambda: ps.push_pull(ones, out={"w": np.ones(3)}), "shape")
            assert ps.clock == 0     # checked before the push went out
        for _ in range(3):   # every worker, the rejected one included, still trains
            ps.push(ones)
            ps.pull()
        wait_all([ps.worker_comm.Ibarrier()])
        return ps.pull(), ps.stats()

    _, res = run_ps(params, worker, num_servers, consistency=consistency, lr=0.5,
                    average=False, **SMALL)
    if isinstance(res, tuple):
        final, stats = res
        want = pushes_of_ones(params, consistency, SIZE - num_servers, times=3)
        for k in params:
            np.testing.assert_array_equal(final[k], want[k])
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


def sgd_steps(params: dict[str, np.ndarray], steps: list[float]) -> dict[str, np.ndarray]:
    """``params`` after sgd updates moving every element down by each of ``steps`` in
    turn, in each tensor's dtype (as the servers apply them)."""
    out = {}
    for k, v in params.items():
        out[k] = v.copy()
        for step in steps:
            out[k] -= np.asarray(step, v.dtype)
    return out


def pushes_of_ones(params: dict[str, np.ndarray], consistency: str, nworkers: int,
                   times: int = 1) -> dict[str, np.ndarray]:
    """``params`` after every worker pushed ones ``times`` times (lr 0.5, summed): one
    update per round (bsp) or one update per push (asp, ssp)."""
    steps = [0.5 * nworkers] if consistency == "bsp" else [0.5] * nworkers
    return sgd_steps(params, steps * times)


@pytest.mark.parametrize("consistency", ["asp", "bsp", "ssp"])
@pytest.mark.parametrize("num_servers", [1, 2])
def test_partly_rejected_push_pull_raises_instead_of_waiting(num_servers, consistency):
    """push_pull(check=False) with one tensor of the wrong shape: that tensor's shards
    reject the push, so under bsp (and ssp with staleness 0) the pull of the same call
    waits there for a round that never closes for this worker (it hung). The servers
    answer such a pull with an error at once: the call raises PSError with the shape error
    and the out-of-step reason, and later calls are refused. Another worker's push_pull
    completes once the first has closed (the bad tensor's round then closes without it)."""
    need_servers(num_servers)
    params = make_params()
    ones = {k: np.ones_like(v) for k, v in params.items()}

    def worker(ps):
        if ps.worker_index == 0:
            expect_ps_error(lambda: ps.push_pull({**ones, "w": ones["w"].reshape(5, 37)},
                                                 check=False), "shape", "out of step")
            expect_ps_error(ps.pull, "out of step")
            return None
        return ps.push_pull(ones) if ps.worker_index == 1 else None

    _, res = run_ps(params, worker, num_servers, consistency=consistency, staleness=0,
                    lr=0.5, average=False, **SMALL)
    if res is not None and "w" in res:
        # w: the second worker's push alone; the others: both pushes (asp: perhaps not
        # the first worker's yet), one update (bsp) or one each (ssp)
        np.testing.assert_array_equal(res["w"], params["w"] - 0.5)
        if consistency != "asp":
            want = sgd_steps(params, [1.0] if consistency == "bsp" else [0.5, 0.5])
            for k in sorted(set(params) - {"w"}):
                np.testing.assert_array_equal(res[k], want[k], err_msg=k)


@pytest.mark.parametrize("consistency", ["asp", "bsp"])
@pytest.mark.parametrize("num_servers", [1, 2])
def test_fully_rejected_push_pull_keeps_the_clock(num_servers, consistency):
    """push_pull(check=False) whose every tensor has the wrong dtype: every shard rejects
    the push, so nothing happened anywhere: the call raises the servers' reasons (bsp: its
    pull is answered with an error at once instead of waiting for a round this worker
    never pushed), the clock stays and is not out of step, and training goes on."""
    need_servers(num_servers)
    params = make_params()
    ones = {k: np.ones_like(v) for k, v in params.items()}
    other = {np.dtype(np.float64): np.float32, np.dtype(np.float32): np.float64}
    bad = {k: v.astype(other[v.dtype]) for k, v in ones.items()}

    def worker(ps):
        if ps.worker_index == 0:
            error = expect_ps_error(lambda: ps.push_pull(bad, check=False), "dtype")
            assert "out of step" not in str(error) and ps.clock == 0, str(error)
        ps.push(ones)
        wait_all([ps.worker_comm.Ibarrier()])
        return ps.pull()

    _, res = run_ps(params, worker, num_servers, consistency=consistency, lr=0.5,
                    average=False, **SMALL)
    if res is not None and "w" in res:
        want = pushes_of_ones(params, consistency, SIZE - num_servers)
        for k in params:
            np.testing.assert_array_equal(res[k], want[k], err_msg=k)


@pytest.mark.parametrize("consistency", ["asp", "bsp"])
@pytest.mark.parametrize("num_servers", [1, 2])
def test_unchecked_push_still_needs_every_parameter(num_servers, consistency):
    """check=False leaves shapes and dtypes to the servers, not names: gradients missing
    some parameters (whose shards would never see this push: the clocks out of step,
    silently) or naming unknown ones raise PSError naming them before anything is sent;
    the clock stays and every worker trains on."""
    need_servers(num_servers)
    params = make_params()
    ones = {k: np.ones_like(v) for k, v in params.items()}

    def worker(ps):
        try:
            if ps.worker_index == 0:
                expect_ps_error(lambda: ps.push({"w": ones["w"]}, check=False),
                                "missing", "'b'", "'v'")
                partial = {k: v for k, v in ones.items() if k != "s"}
                expect_ps_error(lambda: ps.push_pull(partial, check=False),
                                "missing", "['s']")
                expect_ps_error(lambda: ps.push({**ones, "nope": ones["b"]}, check=False),
                                "unknown key 'nope'")
                expect_ps_error(lambda: ps.push(["not", "a", "dict"], check=False), "dict")
                assert ps.clock == 0
            ps.push(ones)
        finally:
            wait_all([ps.worker_comm.Ibarrier()])
        return ps.pull(), ps.stats()

    _, res = run_ps(params, worker, num_servers, consistency=consistency, lr=0.5,
                    average=False, **SMALL)
    if isinstance(res, tuple):
        final, stats = res
        nworkers = SIZE - num_servers
        want = pushes_of_ones(params, consistency, nworkers)
        for k in params:
            np.testing.assert_array_equal(final[k], want[k], err_msg=k)
        # nothing of the refused calls reached a server
        assert sum(s["errors"] for s in stats["servers"]) == 0


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
    with pytest.raises(PSError, match="other settings than rank 0: lr: rank 0 0.1, rank 1 0.2"):
        ParameterServer(params, comm=COMM, lr=0.1 if COMM.Get_rank() == 0 else 0.2)
    if SIZE >= 3:
        mine = dict(params)
        if COMM.Get_rank() == SIZE - 1:
            mine["b"] = np.zeros(4)
        with pytest.raises(PSError, match=r"differ.*rank \d+: \[\('b', \[4\]"):
            ParameterServer(mine, comm=COMM)   # (naming the parameter that differs)


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
