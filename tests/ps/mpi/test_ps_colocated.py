"""The co-located layout (num_servers="colocated"): every rank a worker and a server."""
from __future__ import annotations

import os

import numpy as np
import pytest

from mpicoll.ps import COLOCATED, ParameterServer, PSError
from mpicoll.ps.protocol import wait_all

from ps_cases import (COMM, RANK, SIZE, SMALL, adam_update, assert_params_equal, expect_ps_error,
                      make_grads, make_params, momentum_update, reference_bsp, remove_shared,
                      run_ps, sgd_update, shared_tmpdir)

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(90)]

STEPS = 3
UPDATES = {"sgd": (sgd_update(0.125), dict(lr=0.125)),
           "momentum": (momentum_update(0.1, 0.8), dict(lr=0.1, momentum=0.8)),
           "adam": (adam_update(0.01, 0.9, 0.99, 1e-6),
                    dict(lr=0.01, beta1=0.9, beta2=0.99, eps=1e-6))}


@pytest.mark.parametrize("optimizer", sorted(UPDATES))
def test_bsp_equals_reference(optimizer):
    """Bit-identical to the single-process reference; push+pull, push_pull, async and
    in-place (out = the gradients) all give the same values."""
    update, hyper = UPDATES[optimizer]
    params = make_params()
    grads = [[make_grads(params, w, t) for w in range(SIZE)] for t in range(STEPS)]
    history = reference_bsp(params, grads, update)

    def worker(ps):
        assert ps.worker_index == RANK and ps.num_workers == SIZE and not ps.is_server
        seen = [ps.pull()]
        for t in range(STEPS):
            g = grads[t][RANK]
            if t == 0:
                ps.push(g)
                seen.append(ps.pull())
            elif t == 1:
                seen.append(ps.push_pull_async(g).wait())
            else:   # in place: pulled values overwrite the gradients being pushed
                mine = {k: v.copy() for k, v in g.items()}
                seen.append(ps.push_pull(mine, out=mine))
        return seen

    _, seen = run_ps(params, worker, COLOCATED, optimizer=optimizer, **SMALL, **hyper)
    assert_params_equal(seen[0], params, "initial pull")
    for t in range(STEPS):
        assert_params_equal(seen[t + 1], history[t], f"after step {t + 1}:")


def test_sum_returns_round_aggregate_and_stats():
    params = {"g": np.zeros(41, dtype=np.int64), "h": np.zeros((3, 3), dtype=np.float32)}

    def grads(w, t):
        return {"g": np.arange(41, dtype=np.int64) * (w + 1) + t,
                "h": np.full((3, 3), w + 0.5 * t, dtype=np.float32)}

    def worker(ps):
        first = ps.push_pull_async(grads(RANK, 0))
        second = ps.push_pull_async(grads(RANK, 1))   # completes the first one, then starts
        assert first.test()
        return [first.wait(), second.wait()], ps.stats()

    _, (seen, stats) = run_ps(params, worker, COLOCATED, optimizer="sum", **SMALL)
    for t in range(2):
        want = {k: sum(grads(w, t)[k] for w in range(SIZE)) for k in params}
        assert_params_equal(seen[t], {k: v.astype(params[k].dtype) for k, v in want.items()})
    total = sum(v.nbytes for v in params.values())
    assert len(stats["bytes_per_server"]) == SIZE and sum(stats["bytes_per_server"]) == total
    assert [s["rank"] for s in stats["servers"]] == list(range(SIZE))
    assert sum(s["bytes_stored"] for s in stats["servers"]) == total
    assert stats["worker"]["clock"] == 2 and stats["worker"]["pushes"] == 2
    assert all(s["updates"] == 2 * s["shards"] for s in stats["servers"])


def test_sum_without_keeping_the_aggregate():
    """keep_aggregate=False: push_pull returns the aggregate (also in place); a pull() or
    save() before the next push raises on every rank; push then pull works."""
    params = {"g": np.zeros(41, dtype=np.float32)}

    def grads(t):
        return {"g": np.arange(41, dtype=np.float32) * (RANK + 1) + t}

    def want(t):
        return sum(np.arange(41, dtype=np.float32) * (w + 1) + t for w in range(SIZE))

    def worker(ps):
        out = {"g": np.empty(41, np.float32)}
        np.testing.assert_array_equal(ps.push_pull(grads(0), out=out)["g"], want(0))
        expect_ps_error(ps.pull, "keep_aggregate=False")
        expect_ps_error(lambda: ps.save("/nonexistent"), "keep_aggregate=False")
        mine = grads(1)
        np.testing.assert_array_equal(ps.push_pull(mine, out=mine)["g"], want(1))
        ps.push(grads(2))
        np.testing.assert_array_equal(ps.pull()["g"], want(2))
        return True

    assert run_ps(params, worker, COLOCATED, optimizer="sum", keep_aggregate=False,
                  **SMALL)[1]


def test_early_finish_does_not_block_others():
    """Rank i runs 2 + i steps; a closed rank keeps serving its shards to the others."""
    params = make_params()
    steps = [2 + w for w in range(SIZE)]
    grads = [[make_grads(params, w, t) for w in range(SIZE) if steps[w] > t]
             for t in range(max(steps))]
    history = reference_bsp(params, grads, sgd_update(0.125))

    def worker(ps):
        w = None
        for t in range(steps[RANK]):
            w = ps.push_pull(make_grads(params, RANK, t))
        return w

    _, final = run_ps(params, worker, COLOCATED, lr=0.125, **SMALL)
    assert_params_equal(final, history[steps[RANK] - 1], f"after {steps[RANK]} steps:")


def test_closed_rank_serves_refused_steps_stats_and_saves():
    """Rank 0 closes at once; the others' refused step (bad arguments), stats(), save()
    and a push_pull still go through it: it serves its shards and writes its file."""
    if SIZE < 2:
        pytest.skip("needs a rank that stays after rank 0 closed")
    params = make_params()
    ones = {k: np.ones_like(v) for k, v in params.items()}
    path = shared_tmpdir()
    try:
        def worker(ps):
            if RANK == 0:
                return None
            bad = dict(ones, b=np.ones(4)) if RANK == SIZE - 1 else ones
            expect_ps_error(lambda: ps.push_pull(bad), f"rank(s) [{SIZE - 1}]")
            stats = ps.stats()
            ps.save(path)
            return stats, ps.push_pull(ones)

        _, res = run_ps(params, worker, COLOCATED, lr=0.5, average=False, **SMALL)
        if RANK > 0:
            stats, w = res
            assert [s["rank"] for s in stats["servers"]] == list(range(SIZE))
            assert stats["servers"][0]["active_workers"] == SIZE - 1
            for k in params:
                np.testing.assert_array_equal(w[k], params[k] - 0.5 * (SIZE - 1))
        files = sorted(f for f in os.listdir(path) if f.endswith(".npz"))
        assert len(files) == SIZE and os.path.exists(os.path.join(path, "manifest.json"))
    finally:
        remove_shared(path)


def test_restore_gives_identical_next_step_and_layout_checks():
    params = make_params()
    hyper = dict(optimizer="adam", lr=0.05, beta1=0.8, beta2=0.95)
    path = shared_tmpdir()
    try:
        def train(ps):
            for t in range(2):
                ps.push_pull(make_grads(params, RANK, t))
            ps.save(path)
            return ps.pull(), ps.push_pull(make_grads(params, RANK, 2))

        _, (saved, nxt) = run_ps(params, train, COLOCATED, **hyper, **SMALL)
        files = os.listdir(path)
        assert len([f for f in files if f.endswith(".npz")]) == SIZE, files

        def resume(ps):
            assert ps.clock == 2
            return ps.pull(), ps.push_pull(make_grads(params, RANK, 2))

        _, (restored, nxt2) = run_ps(params, resume, COLOCATED, restore=path, **hyper,
                                     **SMALL)
        assert_params_equal(restored, saved, "restored:")
        assert_params_equal(nxt2, nxt, "next step after restore:")
        if SIZE >= 2:   # one server + (SIZE-1) workers: another layout
            with pytest.raises(PSError, match="layout differs"):
                run_ps(params, lambda ps: None, 1, restore=path, **hyper, **SMALL)
            _, moved = run_ps(params, lambda ps: ps.pull(), 1, restore=path, reshard=True,
                              **hyper, **SMALL)
            if RANK >= 1:
                assert_params_equal(moved, saved, "resharded onto 1 server:")
    finally:
        remove_shared(path)


def test_bad_input_raises_on_every_rank_and_training_goes_on():
    params = make_params()
    ones = {k: np.ones_like(v) for k, v in params.items()}

    def worker(ps):
        bad = dict(ones, b=np.ones(4)) if RANK == SIZE - 1 else ones
        expect_ps_error(lambda: ps.push_pull(bad), f"rank(s) [{SIZE - 1}]")
        if RANK == SIZE - 1:
            expect_ps_error(lambda: ps.push(bad), "shape")
        else:
            expect_ps_error(lambda: ps.push(bad), "bad arguments")
        assert ps.clock == 0
        out = {"ww": np.ones(3)} if RANK == SIZE - 1 else None   # a misspelt out name
        expect_ps_error(lambda: ps.push_pull(ones, out=out), f"rank(s) [{SIZE - 1}]")
        assert ps.clock == 0
        if SIZE > 1:   # ranks that make different calls: PSError everywhere, no hang
            expect_ps_error(ps.pull if RANK == 0 else lambda: ps.push(ones), "same call")
            assert ps.clock == 0
        expect_ps_error(ps.serve, "colocated")
        expect_ps_error(lambda: ps.init(params), "already initialized")
        return ps.push_pull(ones)

    _, w = run_ps(params, worker, COLOCATED, lr=0.5, average=False, **SMALL)
    for k in params:
        np.testing.assert_array_equal(w[k], params[k] - 0.5 * SIZE)


def test_unsupported_options_raise_on_every_rank():
    params = make_params()
    for consistency in ("asp", "ssp"):
        with pytest.raises(ValueError, match="supports only consistency='bsp'"):
            ParameterServer(params, comm=COMM, num_servers=COLOCATED, consistency=consistency)
    with pytest.raises(ValueError, match="init=True"):
        ParameterServer(params, comm=COMM, num_servers=COLOCATED, init=False)
    with pytest.raises(ValueError, match="keep_aggregate=False needs"):
        ParameterServer(params, comm=COMM, num_servers=COLOCATED, keep_aggregate=False)
    with pytest.raises(ValueError, match="'colocated'"):
        ParameterServer(params, comm=COMM, num_servers="all")
    wait_all([COMM.Ibarrier()])
