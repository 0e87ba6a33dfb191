"""Replica routing (mpicoll.ps.replicas) and the replicas= argument, without MPI ranks."""
from __future__ import annotations

import pytest

from mpicoll.ps.replicas import Routing
from mpicoll.ps.settings import check_settings

BASE = dict(consistency="bsp", staleness=0, optimizer="sgd", hyperparameters={},
            average=None, split_bytes=64, chunk_bytes=64, init=True, restore=None,
            reshard=False, keep_aggregate=True)


def test_ring_layout_and_failover_with_a_spare():
    r = Routing(3, 1)
    assert r.holders == [[0, 1], [1, 2], [2, 0]]
    assert [r.slots_of(x) for x in range(3)] == [[0, 2], [0, 1], [1, 2]]
    changes = r.fail([0])
    # slot 0: the backup becomes the primary and the spare (rank 2) the new backup;
    # slot 2 lost its backup: the next live rank after its primary takes over
    assert changes == {0: ([0, 1], [1, 2]), 2: ([2, 0], [2, 1])}
    assert (r.primary(0), r.backup(0), r.primary(2), r.backup(2)) == (1, 2, 2, 1)
    assert r.fail([0]) == {} and r.fail([7]) == {}   # known, or not a server: nothing
    assert r.lost() == []


def test_two_servers_go_on_unreplicated_then_lose_everything():
    r = Routing(2, 1)
    assert r.fail([1]) == {0: ([0, 1], [0]), 1: ([1, 0], [0])}
    assert r.backup(0) is None and r.primary(1) == 0 and r.lost() == []
    r.fail([0])
    assert r.lost() == [0, 1] and r.primary(0) is None


def test_without_replicas_a_dead_server_loses_its_slot():
    r = Routing(2, 0)
    assert r.holders == [[0], [1]]
    r.fail([1])
    assert r.lost() == [1]


@pytest.mark.parametrize("kw,fragment", [
    (dict(num_servers=1), "num_servers >= 2"),
    (dict(num_servers="colocated"), "separate servers"),
    (dict(num_servers=2, compression="int8"), "compression"),
    (dict(num_servers=2, backup_workers=1), "backup_workers"),
    (dict(num_servers=2, replicas=2), "must be 0 or 1"),
    (dict(num_servers=2, replicas=True), "must be 0 or 1"),
])
def test_refused_combinations(kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        check_settings(5, **{**BASE, "replicas": 1, **kw})


def test_supported_combinations():
    for consistency in ("bsp", "asp", "ssp"):
        for optimizer in ("sgd", "momentum", "adam") + (("sum",) if consistency == "bsp" else ()):
            s = check_settings(5, **{**BASE, "consistency": consistency,
                                     "optimizer": optimizer}, num_servers=2, replicas=1)
            assert s.replicas == 1 and s.as_plain()["replicas"] == 1
