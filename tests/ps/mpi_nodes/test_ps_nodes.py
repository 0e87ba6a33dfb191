"""Local aggregation (the node-aware parameter server) against the flat one, bit for bit.

Runs under emulated nodes (``MPICOLL_RANKS_PER_NODE``); CI: n=3 (nodes of 2 and 1), n=4
(2 + 2) and n=5 with 3 ranks per node (3 + 2: one server and two workers on the first
node). The layouts each size gives (workers per node):

=====  ===========================  ================================
n      co-located                   one server (ranks 1..n-1 workers)
=====  ===========================  ================================
3/2    [0, 1], [2]                  [1], [2] (nothing to aggregate)
4/2    [0, 1], [2, 3]               [1], [2, 3]
5/3    [0, 1, 2], [3, 4]            [1, 2], [3, 4]
=====  ===========================  ================================

Gradients are random floats (standard normal, float32 and float64), so a sum in another
order, or a node's contribution lost, changes the bits; every test checks that the
rank-order sum would indeed differ where it claims the node order matters.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "mpi"))

from ps_cases import (COMM, RANK, SIZE, SMALL, adam_update, assert_params_equal,  # noqa: E402
                      expect_ps_error, make_params, momentum_update, remove_shared, run_ps,
                      sgd_update, shared_tmpdir)

from mpicoll.ps import COLOCATED, ParameterServer, PSError  # noqa: E402
from mpicoll.ps.node_order import fold_sum, grouped_order  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(90)]

if not os.environ.get("MPICOLL_RANKS_PER_NODE"):
    pytest.skip("runs under emulated nodes (MPICOLL_RANKS_PER_NODE)", allow_module_level=True)

PER_NODE = int(os.environ["MPICOLL_RANKS_PER_NODE"])
NODE_OF = [r // PER_NODE for r in range(SIZE)]
STEPS = 3
#: optimizer -> (a fresh reference update (they keep state), hyperparameters)
UPDATES = {"sgd": (lambda: sgd_update(0.125), dict(lr=0.125)),
           "momentum": (lambda: momentum_update(0.1, 0.8), dict(lr=0.1, momentum=0.8)),
           "adam": (lambda: adam_update(0.01, 0.9, 0.99, 1e-6),
                    dict(lr=0.01, beta1=0.9, beta2=0.99, eps=1e-6)),
           "sum": (lambda: None, {})}


def groups_for(num_servers) -> list[list[int]]:
    """Worker ranks per node (nodes with workers), as the constructor derives them."""
    first = 0 if num_servers == COLOCATED else num_servers
    groups: dict[int, list[int]] = {}
    for w in range(first, SIZE):
        groups.setdefault(NODE_OF[w], []).append(w)
    return [groups[k] for k in sorted(groups)]


def layouts() -> list:
    """Layouts where some node holds two workers or more (local aggregation has work)."""
    out = []
    for ns in (COLOCATED, 1):
        if ns != COLOCATED and ns >= SIZE:
            continue
        if any(len(g) > 1 for g in groups_for(ns)):
            out.append(ns)
    return out


def random_grads(params: dict, rank: int, step: int) -> dict:
    rng = np.random.default_rng([7, rank, step])
    return {k: np.asarray(rng.standard_normal(v.shape) * (1 + rank % 3), dtype=v.dtype)
            for k, v in params.items()}


def node_sum(grads_by_rank: dict, ranks: list[int], node_of) -> dict:
    """The sum the node order prescribes (an independent left fold per node)."""
    order, sizes = grouped_order(ranks, node_of)
    out = {}
    for name in grads_by_rank[ranks[0]]:
        parts = [np.array(grads_by_rank[r][name], copy=True) for r in order]
        out[name] = fold_sum(parts[0], parts, sizes)
    return out


def reference(params: dict, optimizer: str, workers: list[int]) -> list[dict]:
    """Single process: each round the node-order sum, averaged, then the update."""
    update = UPDATES[optimizer][0]()
    w = {k: v.copy() for k, v in params.items()}
    history = []
    for t in range(STEPS):
        grads = {r: random_grads(params, r, t) for r in workers}
        acc = node_sum(grads, workers, NODE_OF)
        if optimizer == "sum":
            history.append({k: v.copy() for k, v in acc.items()})
            continue
        for name in sorted(w):
            a = acc[name]
            if len(workers) > 1:
                np.divide(a, len(workers), out=a)
            update(name, w[name], a, t + 1)
        history.append({k: v.copy() for k, v in w.items()})
    return history


def test_rank_order_would_differ():
    """The test data tell the node order from rank order (else the tests below could
    not fail on a wrong order)."""
    params = make_params()
    for ns in layouts():
        workers = [w for g in groups_for(ns) for w in g]
        grads = {r: random_grads(params, r, 0) for r in workers}
        by_node = node_sum(grads, workers, NODE_OF)
        by_rank = node_sum(grads, workers, None)
        if sum(len(g) > 1 for g in groups_for(ns)[1:]) or len(groups_for(ns)[0]) > 2:
            assert not np.array_equal(by_node["w"], by_rank["w"]), ns


@pytest.mark.parametrize("optimizer", sorted(UPDATES))
@pytest.mark.parametrize("num_servers", [COLOCATED, 1], ids=["colocated", "1server"])
def test_bsp_node_aware_equals_flat(num_servers, optimizer):
    """bsp: every pull of the node-aware run equals the flat run's and the single-process
    node-order reference, bit for bit (push+pull, push_pull, an async handle polled with
    test() until complete, in place)."""
    if num_servers not in layouts():
        pytest.skip("no node holds two workers in this layout")
    params = make_params()
    workers = [w for g in groups_for(num_servers) for w in g]
    history = reference(params, optimizer, workers)
    _, hyper = UPDATES[optimizer]

    def worker(ps):
        seen = [] if optimizer == "sum" else [ps.pull()]
        for t in range(STEPS):
            g = random_grads(params, RANK, t)
            if t == 0:
                ps.push(g)
                seen.append(ps.pull())
            elif t == 1:     # polled: a node's handle tests the leader's (or waits on it)
                h = ps.push_pull_async(g)
                while not h.test():
                    time.sleep(1e-4)
                assert h.test()
                seen.append(h.wait())
            else:
                mine = {k: v.copy() for k, v in g.items()}
                seen.append(ps.push_pull(mine, out=mine))
        return seen, ps.stats()

    runs = {}
    for la in (True, False):
        ps, result = run_ps(params, worker, num_servers, optimizer=optimizer,
                            local_aggregation=la, **SMALL, **hyper)
        assert ps.local_aggregation is la
        runs[la] = result
    if RANK not in workers:
        return
    (node_seen, node_stats), (flat_seen, flat_stats) = runs[True], runs[False]
    assert node_stats["local_aggregation"] and not flat_stats["local_aggregation"]
    assert node_stats["worker"]["node_workers"] == len(
        next(g for g in groups_for(num_servers) if RANK in g))
    for a, b in zip(node_seen, flat_seen):
        assert_params_equal(a, b, "node-aware vs flat")
    offset = 0 if optimizer == "sum" else 1
    if offset:
        assert_params_equal(node_seen[0], params, "initial pull")
    for t in range(STEPS):
        assert_params_equal(node_seen[t + offset], history[t], f"step {t + 1} vs reference")
    # each server shard got one push per node and round (flat: one per worker)
    nodes, n_workers = len(groups_for(num_servers)), len(workers)
    for s in node_stats["servers"]:
        if s["updates"]:
            assert s["pushes"] == s["updates"] * nodes, s
    for s in flat_stats["servers"]:
        if s["updates"]:
            assert s["pushes"] == s["updates"] * n_workers, s


@pytest.mark.parametrize("consistency,optimizer", [("asp", "momentum"), ("ssp", "adam")])
def test_async_node_aware_equals_flat_with_node_sums(consistency, optimizer):
    """asp/ssp: with the nodes pushing one after the other (a barrier between them) and
    every worker's pull after every node pushed and before the next push, the node-aware run equals, bit for bit, the flat server
    driven by one worker per node that pushes its node's summed gradient (the node's other
    workers closed): one update per node push, divided by the number of workers."""
    if 1 not in layouts():
        pytest.skip("no node holds two workers with one server")
    params = make_params()
    groups = groups_for(1)
    _, hyper = UPDATES[optimizer]

    def schedule(node_aware: bool):
        def worker(ps):
            group = next(g for g in groups if RANK in g)
            leader = group[0] == RANK
            acting = node_aware or leader
            if not acting:
                ps.close()           # flat: the node's other workers do not push
            seen = []
            for t in range(STEPS):
                for k, g in enumerate(groups):
                    if g is group and acting:
                        if node_aware:
                            ps.push(random_grads(params, RANK, t))
                        else:
                            grads = {r: random_grads(params, r, t) for r in group}
                            ps.push(node_sum(grads, group, NODE_OF))
                    ps.worker_comm.Barrier()
                if acting:
                    seen.append(ps.pull())
                ps.worker_comm.Barrier()    # every pull answered before the next push
            return seen, ps.stats() if acting else None
        return worker

    runs = {}
    for la in (True, False):
        _, runs[la] = run_ps(params, schedule(la), 1, consistency=consistency,
                             staleness=1, optimizer=optimizer, local_aggregation=la,
                             **SMALL, **hyper)
    # the flat run's values live on the leaders: every rank gets them
    flats = COMM.allgather(runs[False][0] if RANK and runs[False][1] is not None else None)
    if RANK == 0:
        return
    node_seen, node_stats = runs[True]
    group = next(g for g in groups if RANK in g)
    assert len(node_seen) == STEPS and len(flats[group[0]]) == STEPS
    for t, (a, b) in enumerate(zip(node_seen, flats[group[0]])):
        assert_params_equal(a, b, f"step {t + 1}: node-aware vs flat with node sums")
    for s in node_stats["servers"]:     # one update per node push
        assert s["pushes"] == s["updates"] == STEPS * len(groups) * s["shards"], s


def test_auto_and_off_switch():
    """``"auto"`` turns local aggregation on exactly where the workers span several nodes
    and one node holds two or more; ``False`` keeps every worker pushing for itself."""
    params = make_params()
    for ns in (COLOCATED, 1):
        if ns != COLOCATED and ns >= SIZE:
            continue
        groups = groups_for(ns)
        want = len(groups) > 1 and any(len(g) > 1 for g in groups)
        for la, expect in (("auto", want), (False, False), (True, any(len(g) > 1
                                                                      for g in groups))):
            def worker(ps):
                ps.push_pull(random_grads(params, RANK, 0))
                return ps.worker_counters()
            ps, counters = run_ps(params, worker, ns, local_aggregation=la, **SMALL)
            assert ps.local_aggregation is expect, (ns, la)
            if ps.is_worker:
                assert counters.get("local_aggregation", False) is expect
                if expect:
                    group = next(g for g in groups if RANK in g)
                    leader = RANK == group[0]
                    assert counters["node_leader"] is leader
                    if not leader:      # the node's other workers send nothing themselves
                        assert counters["bytes_sent"] == counters["bytes_received"] == 0


def test_bad_and_disagreeing_values_raise_everywhere():
    params = make_params()
    ns = COLOCATED
    with pytest.raises(ValueError, match="local_aggregation='yes' must be"):
        ParameterServer(params, comm=COMM, num_servers=ns, local_aggregation="yes")
    with pytest.raises(ValueError, match="local_aggregation=1 must be"):
        ParameterServer(params, comm=COMM, num_servers=ns, local_aggregation=1)
    bad = "yes" if RANK == SIZE - 1 else "auto"
    with pytest.raises(ValueError, match=f"rank {SIZE - 1}: ValueError: local_aggregation"):
        ParameterServer(params, comm=COMM, num_servers=ns, local_aggregation=bad)
    mixed = False if RANK == SIZE - 1 else "auto"
    with pytest.raises(PSError, match="passed other settings"):
        ParameterServer(params, comm=COMM, num_servers=ns, local_aggregation=mixed)
    if SIZE >= 3:
        with pytest.raises(ValueError, match="local_aggregation=True does not work with "
                                             "backup_workers=1"):
            ParameterServer(params, comm=COMM, num_servers=1, backup_workers=1,
                            local_aggregation=True)
        with pytest.raises(ValueError, match="init=False"):
            ParameterServer(params, comm=COMM, num_servers=1, init=False,
                            local_aggregation=True)
        # "auto" falls back to the flat path with backup workers
        def worker(ps):
            return ps.push_pull(random_grads(params, RANK, 0))
        ps, _ = run_ps(params, worker, 1, backup_workers=1, **SMALL)
        assert ps.local_aggregation is False


def test_node_workers_must_agree():
    """Workers of one node that make different calls, or one of which passes bad
    gradients, raise the same PSError on every worker of the node; nothing was sent, and
    the next proper step equals the flat run's."""
    ns = COLOCATED if all(len(g) > 1 for g in groups_for(COLOCATED)) else 1
    if ns == 1 and (1 >= SIZE or not all(len(g) > 1 for g in groups_for(1))):
        pytest.skip("needs every node to hold two workers or more")
    params = make_params()
    groups = groups_for(ns)

    def worker(ps):
        local = next(g for g in groups if RANK in g).index(RANK)
        g = random_grads(params, RANK, 0)
        if local == 0:
            expect_ps_error(lambda: ps.push(g), "same call at the same step",
                            "local rank 1: pull")
        else:
            expect_ps_error(lambda: ps.pull(), "same call at the same step")
        wrong = dict(g, w=g["w"][:3]) if local == 1 else g
        expect_ps_error(lambda: ps.push_pull(wrong), "passed bad arguments")
        assert ps.clock == 0
        return ps.push_pull(g)

    got = {}
    for la in (True, False):
        if la:
            _, got[la] = run_ps(params, worker, ns, local_aggregation=True, **SMALL)
        else:
            _, got[la] = run_ps(params, lambda ps: ps.push_pull(random_grads(params, RANK, 0)),
                                ns, local_aggregation=False, **SMALL)
    if RANK in [w for g in groups for w in g]:
        assert_params_equal(got[True], got[False], "after the refused steps")


@pytest.mark.parametrize("num_servers", [COLOCATED, 1], ids=["colocated", "1server"])
def test_checkpoint_restores_across_the_switch(num_servers):
    """save() with local aggregation, then restore with it and without it (separate
    servers: the same placement; co-located: the node-aware layout has one owner per
    node, so the flat restore needs reshard=True): the next steps equal the uninterrupted
    node-aware run's, bit for bit."""
    if num_servers not in layouts():
        pytest.skip("no node holds two workers in this layout")
    params = make_params()
    hyper = dict(optimizer="adam", lr=0.01)
    path = shared_tmpdir()
    try:
        def train(ps, steps, save_at=None):
            seen = []
            for t in range(ps.clock, steps):
                seen.append(ps.push_pull(random_grads(params, RANK, t)))
                if save_at == t + 1:
                    ps.save(path)
            return seen

        _, full = run_ps(params, lambda ps: train(ps, STEPS + 1, save_at=2), num_servers,
                         local_aggregation=True, **SMALL, **hyper)
        for la in (True, False):
            reshard = num_servers == COLOCATED and not la
            ps, rest = run_ps(None if RANK < (0 if num_servers == COLOCATED else 1) else
                             params, lambda ps: (ps.clock, train(ps, STEPS + 1)),
                             num_servers, local_aggregation=la, restore=path,
                             reshard=reshard, **SMALL, **hyper)
            if ps.is_worker:
                clock, seen = rest
                assert clock == 2
                for a, b in zip(seen, full[2:]):
                    assert_params_equal(a, b, f"restored (local_aggregation={la})")
    finally:
        remove_shared(path)


def test_asp_checkpoint_with_uneven_clocks_restores_node_aware():
    """A flat asp checkpoint whose workers pushed different numbers of times (worker i:
    1 + i pushes) restored with local aggregation (one server, the same placement): the
    workers of a node start at one clock (the largest of theirs), so their first push is
    not refused ('workers of a node are at different clocks'); with the nodes pushing one
    after the other, the values are the saved ones with each node's averaged sum applied.
    (Before the fix every call of such a node failed, close() too: the server waited for
    it and the test ran into its timeout.)"""
    if 1 not in layouts():
        pytest.skip("no node holds two workers with one server")
    params = make_params()
    groups = groups_for(1)
    lr = 0.125
    path = shared_tmpdir()
    try:
        def save(ps):
            for t in range(1 + ps.worker_index):
                ps.push(random_grads(params, RANK, t))
            ps.worker_comm.Barrier()          # every push applied before the pull
            saved = ps.pull()
            ps.save(path)
            return saved, ps.clock

        _, res = run_ps(params, save, 1, consistency="asp", optimizer="sgd", lr=lr,
                        local_aggregation=False, **SMALL)
        every = COMM.allgather(res if RANK else None)
        saved = every[1][0]

        def restore(ps):
            clock = ps.clock
            restored = ps.pull()
            ps.worker_comm.Barrier()          # every restore pull answered before a push
            group = next(g for g in groups if RANK in g)
            for g in groups:                  # one node after the other
                if g is group:
                    ps.push(random_grads(params, RANK, 5))
                ps.worker_comm.Barrier()
            return clock, ps.clock, restored, ps.pull()

        _, got = run_ps(params, restore, 1, consistency="asp", optimizer="sgd", lr=lr,
                        local_aggregation=True, restore=path, **SMALL)
        if RANK == 0:
            return
        group = next(g for g in groups if RANK in g)
        clock, after, restored, pulled = got
        assert clock == max(every[w][1] for w in group), (clock, [every[w][1] for w in group])
        assert after == clock + 1
        assert_params_equal(restored, saved, "restored:")
        want = {k: v.copy() for k, v in saved.items()}
        n_workers = sum(len(g) for g in groups)
        for g in groups:
            acc = node_sum({r: random_grads(params, r, 5) for r in g}, g, NODE_OF)
            for name in sorted(want):
                np.divide(acc[name], n_workers, out=acc[name])
                sgd_update(lr)(name, want[name], acc[name], 1)
        for k, v in want.items():
            np.testing.assert_allclose(pulled[k], v, rtol=1e-6, err_msg=k)
    finally:
        remove_shared(path)


@pytest.mark.parametrize("num_servers", [COLOCATED, 1], ids=["colocated", "1server"])
def test_compression_with_local_aggregation(num_servers):
    """int8 with local aggregation: the leader encodes the node's sum; every worker of a
    node holds the same values, within int8's error of the uncompressed run, and the
    leader sends what one worker sends flat (its node's other workers nothing)."""
    if num_servers not in layouts():
        pytest.skip("no node holds two workers in this layout")
    params = make_params()
    params = {k: v for k, v in params.items() if v.dtype.kind == "f"}

    def worker(ps):
        seen = None
        for t in range(STEPS):
            seen = ps.push_pull(random_grads(params, RANK, t))
        return seen, ps.worker_counters()

    _, coded = run_ps(params, worker, num_servers, local_aggregation=True,
                      compression="int8", optimizer="sgd", lr=0.05, **SMALL)
    _, exact = run_ps(params, worker, num_servers, local_aggregation=True,
                      optimizer="sgd", lr=0.05, **SMALL)
    groups = groups_for(num_servers)
    group = next((g for g in groups if RANK in g), None)
    node_comm = COMM.Split(MPI.UNDEFINED if group is None else groups.index(group), RANK)
    if group is None:
        return
    try:
        mine = node_comm.bcast(coded[0], root=0)
    finally:
        node_comm.Free()
    assert_params_equal(coded[0], mine, "every worker of a node")
    for k in params:
        np.testing.assert_allclose(coded[0][k], exact[0][k], atol=0.05, rtol=0)
    if RANK != group[0]:
        assert coded[1]["bytes_sent"] == 0


def test_device_arrays_with_local_aggregation():
    """Fake device arrays (tests/gpu/mpi's simulated backend) through local aggregation:
    the same bits as host arrays, co-located and with one server, int8 too."""
    gpu = os.path.join(os.path.dirname(__file__), "..", "..", "gpu")
    sys.path[:0] = [gpu, os.path.join(gpu, "mpi")]
    from gpu_helpers import SimulatedBackend
    from test_ps_device_mpi import FakeSide, train

    from mpicoll.gpu import backends

    for layout, compression in [(COLOCATED, None), (1, "int8:8")]:
        if layout not in layouts():
            continue
        want = train(layout, compression)
        with backends.registered(SimulatedBackend()):
            got = train(layout, compression, FakeSide)
        assert got == want, (layout, compression)
