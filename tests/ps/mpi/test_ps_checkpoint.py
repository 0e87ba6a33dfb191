"""save -> restore -> the identical next step; layout checks; atomic files."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from mpi4py import MPI

from mpicoll.ps import COLOCATED, ParameterServer, PSError
from mpicoll.ps import checkpoint as ckpt
from mpicoll.ps.protocol import wait_all

from ps_cases import (COMM, RANK, SIZE, SMALL, assert_params_equal, expect_ps_error,
                      make_grads, make_params, need_servers, reference_bsp, remove_shared,
                      run_ps, sgd_update, shared_tmpdir)

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


def test_failed_saves_raise_on_every_worker(monkeypatch):
    """A save the servers cannot write (the path is a file), workers naming other
    directories, workers saving at different bsp steps, and a worker whose compression
    state cannot be written: every worker raises the same PSError with the reason, and
    training goes on with the right values."""
    need_servers(1)
    params = make_params()
    ones = {k: np.ones_like(v) for k, v in params.items()}
    path = shared_tmpdir()
    blocked = os.path.join(path, "file")
    if COMM.Get_rank() == 0:
        with open(blocked, "w") as f:
            f.write("x")
    try:
        def worker(ps):
            expect_ps_error(lambda: ps.save(blocked), f"save({blocked!r}) failed",
                            "writing the checkpoint failed")
            if ps.num_workers > 1:
                mine = os.path.join(path, f"w{ps.worker_index}")
                expect_ps_error(lambda: ps.save(mine), "asked for different checkpoints")
                if ps.worker_index == 0:       # its push opens a round the others join later
                    ps.push(ones)
                expect_ps_error(lambda: ps.save(path), "a bsp round is incomplete")
                if ps.worker_index != 0:
                    ps.push(ones)
            else:
                ps.push(ones)
            return ps.pull()

        _, w = run_ps(params, worker, 1, lr=0.5, **SMALL)
        if w is not None and "server" not in w:
            assert_params_equal(w, {k: v - np.asarray(0.5, v.dtype) for k, v in params.items()})

        def codec_worker(ps):
            if ps.worker_index == ps.num_workers - 1:
                def broken(*args):
                    raise OSError("disk full")
                monkeypatch.setattr(ckpt, "write_codec_file", broken)
            expect_ps_error(lambda: ps.save(path), "writing the compression state failed",
                            "disk full")
            return ps.push_pull(ones)

        run_ps(params, codec_worker, 1, compression="bf16", **SMALL)
    finally:
        remove_shared(path)


def test_asp_checkpoint_with_uneven_clocks_restores_colocated():
    """An asp checkpoint whose workers pushed different numbers of times (clocks 1, 2, ...)
    restored with reshard=True into the co-located layout with the same number of workers
    (a sub-communicator of as many ranks): every rank starts at the same clock (the
    largest saved), the restored values are the saved ones and the next push_pull is the
    bsp step on them (not 'ranks push at different clocks')."""
    need_servers(1)
    if SIZE < 3:
        pytest.skip("needs two workers to save different clocks")
    params = make_params()
    path = shared_tmpdir()
    try:
        def worker(ps):
            for t in range(1 + ps.worker_index):
                ps.push(make_grads(params, ps.worker_index, t))
            wait_all([ps.worker_comm.Ibarrier()])    # every push applied before the pull
            saved = ps.pull()
            ps.save(path)
            return saved, ps.clock

        _, res = run_ps(params, worker, 1, consistency="asp", optimizer="sgd", lr=0.25, **SMALL)
        saved = COMM.bcast(res[0] if RANK == 1 else None, root=1)
        clocks = COMM.allgather(res[1] if RANK > 0 else None)[1:]
        assert clocks == list(range(1, SIZE)), clocks
        sub = COMM.Split(0 if RANK < SIZE - 1 else MPI.UNDEFINED, RANK)
        if sub != MPI.COMM_NULL:
            ps = ParameterServer(params, comm=sub, num_servers=COLOCATED, optimizer="sgd",
                                 lr=0.25, restore=path, reshard=True, **SMALL)
            try:
                assert ps.clock == SIZE - 1, ps.clock
                restored = ps.pull()
                grads = [make_grads(params, r, 9) for r in range(SIZE - 1)]
                nxt = ps.push_pull(grads[RANK])
                assert ps.clock == SIZE
            finally:
                ps.close()
                ps.free()
                sub.Free()
            assert_params_equal(restored, saved, "restored:")
            want = reference_bsp(saved, [grads], sgd_update(0.25))[0]
            assert_params_equal(nxt, want, "next step after the co-located restore:")
    finally:
        remove_shared(path)
