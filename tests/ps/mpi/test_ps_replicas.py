"""``replicas=1`` without failures: the layout (every slot on a primary and a backup rank),
the backups hold exactly the primaries' bits, results equal ``replicas=0`` bit for bit,
checkpoints, and the combinations refused (failover itself: tests/faults/test_ps_replicas.py)."""
from __future__ import annotations

import pickle
import time

import numpy as np
import pytest

from mpicoll.ps import ParameterServer, PSError
from ps_cases import (COMM, RANK, SIZE, SMALL, assert_params_equal, make_grads, make_params,
                      remove_shared, run_ps, shared_tmpdir)

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

STEPS = 4
def need(k: int) -> None:
    if k >= SIZE:
        pytest.skip(f"{k} servers need more than {SIZE} ranks")


def _train(ps: ParameterServer, consistency: str) -> list[dict]:
    params = make_params()
    seen = [ps.pull()]
    for t in range(STEPS):
        g = make_grads(params, ps.worker_index, t)
        if t % 2:
            ps.push(g)
            seen.append(ps.pull())
        else:
            seen.append(ps.push_pull(g))
    return seen


def _held(ps: ParameterServer) -> bytes | None:
    """A server's copy of every slot it holds: slot -> ident -> (param, optimizer state,
    version, clocks), pickled (compared across ranks)."""
    if not ps.is_server:
        return None
    out = {slot: {ident: (st.param, st.opt.state, st.opt.steps, st.version, st.clocks)
                  for ident, st in g.states.items()}
           for slot, g in ps._server.groups.items()}
    return pickle.dumps(out)


@pytest.mark.parametrize("k,consistency,optimizer", [
    (2, "bsp", "sgd"), (2, "bsp", "adam"), (2, "bsp", "sum"), (2, "asp", "momentum"),
    (2, "ssp", "sgd"), (3, "bsp", "adam"), (3, "asp", "sgd")])
def test_replicas_equal_unreplicated_and_backups_hold_the_same_bits(k, consistency, optimizer):
    need(k)
    if consistency != "bsp" and SIZE - k > 1:
        pytest.skip("asp/ssp with several workers depend on arrival order")
    kw = dict(consistency=consistency, optimizer=optimizer, staleness=1, **SMALL)
    results, held = {}, None
    for replicas in (0, 1):
        def worker(ps):
            return _train(ps, consistency)
        holder = {}

        def between(ps):
            holder["ps"] = ps
        ps, out = run_ps(make_params(), worker, k, between=between, replicas=replicas, **kw)
        results[replicas] = out
        if replicas:
            held = COMM.allgather(_held(ps))
            assert ps.replicas == 1
    if RANK >= k:
        for t, (a, b) in enumerate(zip(results[0], results[1])):
            assert_params_equal(b, a, f"step {t}, replicas=1 vs 0:")
    # layout: server s holds slot s (primary) and slot s-1 (backup), and both copies of
    # every slot are the same bits
    copies: dict[int, list[bytes]] = {}
    for rank, blob in enumerate(held[:k]):
        slots = pickle.loads(blob)
        assert sorted(slots) == sorted({rank, (rank - 1) % k}), (rank, sorted(slots))
        for slot, states in slots.items():
            copies.setdefault(slot, []).append(pickle.dumps(
                {i: (p.tobytes(), {n: a.tobytes() for n, a in o.items()}, s, v, c)
                 for i, (p, o, s, v, c) in sorted(states.items())}))
    for slot, blobs in copies.items():
        assert len(blobs) == 2 and blobs[0] == blobs[1], f"slot {slot}: backup differs"


def test_push_is_acknowledged_only_once_the_backup_holds_it():
    """Backups replay forwarded pushes slowly (a 0.03 s pause each); every push a worker
    saw acknowledged had already been applied by the backup of each slot it touched
    (an early acknowledgement would return before the backup's record)."""
    k = 2
    need(k)
    params = make_params()
    applied = []     # backups: (worker rank, clock, time applied)

    def slow_backups(ps):
        if not ps.is_server:
            return
        server = ps._server
        original = server._forwarded

        def forwarded(src, h):
            from mpicoll.ps import protocol as P
            if int(h[P.OP]) == P.Op.PUSH:
                time.sleep(0.03)
                original(src, h)
                applied.append((int(h[P.AUX]), int(h[P.CLOCK]), time.time()))
            else:
                original(src, h)
        server._forwarded = forwarded

    def worker(ps):
        acked = []
        for t in range(2):
            ps.push(make_grads(params, ps.worker_index, t))
            acked.append((ps.rank, t, time.time()))
        return acked

    _, acked = run_ps(params, worker, k, between=slow_backups, replicas=1,
                      consistency="bsp", optimizer="sgd", **SMALL)
    everything = COMM.allgather((applied, acked if RANK >= k else []))
    backups = [a for b, _ in everything for a in b]
    acks = {(w, t): when for _, a in everything for w, t, when in a}
    assert len(acks) == 2 * (SIZE - k)
    assert {(w, t) for w, t, _ in backups} == set(acks)
    for w, t, when in backups:
        assert when <= acks[(w, t)], f"push {t} of rank {w} acknowledged before the backup held it"


def test_checkpoint_with_replicas_restores_unreplicated_and_back():
    k = 2
    need(k)
    path = shared_tmpdir()
    params = make_params()
    try:
        def save_after_two(ps):
            for t in range(2):
                ps.push_pull(make_grads(params, ps.worker_index, t))
            ps.save(path)
            return ps.push_pull(make_grads(params, ps.worker_index, 2))
        kw = dict(consistency="bsp", optimizer="adam", lr=0.01, **SMALL)
        _, ref = run_ps(params, save_after_two, k, replicas=1, **kw)

        def resume(ps):
            return ps.push_pull(make_grads(params, ps.worker_index, 2))
        for replicas in (0, 1):
            _, got = run_ps(params, resume, k, replicas=replicas, restore=path, **kw)
            if RANK >= k:
                assert_params_equal(got, ref, f"restored with replicas={replicas}:")
    finally:
        remove_shared(path)


@pytest.mark.parametrize("kw,fragment", [
    (dict(num_servers=1), "num_servers >= 2"),
    (dict(num_servers="colocated"), "separate servers"),
    (dict(num_servers=2, compression="fp16"), "compression"),
    (dict(num_servers=2, backup_workers=1), "backup_workers"),
    (dict(num_servers=2, replicas=2), "must be 0 or 1"),
])
def test_unsupported_combinations_fail_on_every_rank(kw, fragment):
    if SIZE < 4 and kw.get("backup_workers"):
        pytest.skip("backup_workers=1 needs 2 workers")
    if kw.get("num_servers") == 2 and SIZE < 3:
        pytest.skip("2 servers need 3 ranks")
    kw = {"replicas": 1, **kw}
    with pytest.raises(ValueError) as info:
        ParameterServer(make_params(), comm=COMM, **kw)
    assert fragment in str(info.value), str(info.value)
    assert np.all(np.array(COMM.allgather(1)) == 1)   # every rank got here


def test_bad_push_rejected_by_the_primary_training_goes_on():
    """A push of the wrong dtypes (``check=False``: only the servers check them) reaches
    a replicated server, which answers with the reason; the worker's next pushes apply."""
    need(2)
    params = make_params()
    ones = {k: np.ones_like(v) for k, v in params.items()}
    other = {np.dtype(np.float64): np.float32, np.dtype(np.float32): np.float64}

    def worker(ps):
        if ps.worker_index == 0:
            with pytest.raises(PSError, match="dtype"):
                ps.push({k: v.astype(other[v.dtype]) for k, v in ones.items()}, check=False)
            assert ps.clock == 0
        return ps.push_pull(ones)

    _, w = run_ps(params, worker, 2, replicas=1, lr=0.5, **SMALL)
    if RANK >= 2:
        assert_params_equal(w, {k: v - np.asarray(0.5, v.dtype) for k, v in params.items()})
