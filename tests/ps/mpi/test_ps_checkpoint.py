"""save -> restore -> the identical next step; layout checks; atomic files."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from mpicoll.ps import PSError
from mpicoll.ps.protocol import wait_all

from ps_cases import (COMM, SIZE, SMALL, assert_params_equal, make_grads, make_params,
                      need_servers, remove_shared, run_ps, shared_tmpdir)

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(90)]

HYPER = dict(optimizer="adam", lr=0.05, beta1=0.8, beta2=0.95)


def _train_and_save(path, num_servers, consistency="bsp", **kw):
    params = make_params()

    def worker(ps):
        for t in range(3):
            ps.push_pull(make_grads(params, ps.worker_index, t))
        ps.save(path)
        saved = ps.pull()
        # no worker pushes again before every worker has pulled (ssp/asp apply on arrival)
        wait_all([ps.worker_comm.Ibarrier()])
        ps.save(path)             # a second save replaces the first atomically
        nxt = ps.push_pull(make_grads(params, ps.worker_index, 3))
        return saved, nxt, ps.clock

    return run_ps(params, worker, num_servers, consistency=consistency, **HYPER, **kw)[1]


@pytest.mark.parametrize("num_servers", [1, 2])
@pytest.mark.parametrize("consistency", ["bsp", "ssp"])
def test_restore_gives_identical_next_step(num_servers, consistency):
    need_servers(num_servers)
    path = shared_tmpdir()
    try:
        res = _train_and_save(path, num_servers, consistency, staleness=0, **SMALL)
        files = sorted(os.listdir(path))
        assert "manifest.json" in files
        assert len([f for f in files if f.endswith(".npz")]) == num_servers, files
        assert not [f for f in files if f.startswith(".tmp-")], files
        params = make_params()

        def worker(ps):
            restored = ps.pull()
            clock = ps.clock
            wait_all([ps.worker_comm.Ibarrier()])   # (ssp: nobody pushes before all pulled)
            nxt = ps.push_pull(make_grads(params, ps.worker_index, 3))
            return restored, clock, nxt

        _, again = run_ps(params, worker, num_servers, consistency=consistency, staleness=0,
                          restore=path, **HYPER, **SMALL)
        if isinstance(res, tuple):
            saved, nxt, clock = res
            restored, clock2, nxt2 = again
            assert clock2 == clock - 1 == 3
            assert_params_equal(restored, saved, "restored:")
            if consistency == "bsp":
                assert_params_equal(nxt2, nxt, "next step after restore:")
    finally:
        remove_shared(path)


def test_other_layout_refused_unless_reshard():
    need_servers(1)
    path = shared_tmpdir()
    try:
        res = _train_and_save(path, 1, chunk_bytes=96, split_bytes=64)
        params = make_params()

        def worker(ps):
            return ps.pull(), ps.push_pull(make_grads(params, ps.worker_index, 3))

        # another split threshold: a different layout with the same number of workers
        with pytest.raises(PSError, match="reshard=True"):
            run_ps(params, worker, 1, restore=path, split_bytes=1 << 20, **HYPER)
        _, again = run_ps(params, worker, 1, restore=path, reshard=True,
                          split_bytes=1 << 20, **HYPER)
        if isinstance(res, tuple):
            assert_params_equal(again[0], res[0], "resharded restore:")
            assert_params_equal(again[1], res[1], "next step after reshard:")
        if SIZE >= 3:
            # two servers instead of one (so one worker fewer): values and state move over
            with pytest.raises(PSError, match="layout differs"):
                run_ps(params, worker, 2, restore=path, **HYPER, **SMALL)
            _, moved = run_ps(params, lambda ps: ps.pull(), 2, restore=path, reshard=True,
                              **HYPER, **SMALL)
            if isinstance(res, tuple) and COMM.Get_rank() >= 2:
                assert_params_equal(moved, res[0], "restored on 2 servers:")
    finally:
        remove_shared(path)


def test_restore_refuses_other_parameters_and_missing_checkpoint():
    need_servers(1)
    path = shared_tmpdir()
    try:
        _train_and_save(path, 1)
        other = make_params()
        other["extra"] = np.zeros(3)
        with pytest.raises(PSError, match="other parameters"):
            run_ps(other, lambda ps: None, 1, restore=path, **HYPER)
        with pytest.raises(PSError, match="optimizer"):
            run_ps(make_params(), lambda ps: None, 1, restore=path, optimizer="sgd")
        with pytest.raises(PSError, match="cannot read checkpoint"):
            run_ps(make_params(), lambda ps: None, 1, restore=os.path.join(path, "nope"),
                   **HYPER)
        if COMM.Get_rank() == 0:
            with open(os.path.join(path, "manifest.json")) as f:
                manifest = json.load(f)
            assert manifest["optimizer"] == "adam" and manifest["num_workers"] == SIZE - 1
    finally:
        remove_shared(path)
