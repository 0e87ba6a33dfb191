"""Serial unit tests of the parameter server's pieces (no MPI job needed)."""
from __future__ import annotations

import json
import os
import zlib

import numpy as np
import pytest

from mpicoll.ps import checkpoint as ckpt
from mpicoll.ps import protocol as P
from mpicoll.ps.errors import PSError
from mpicoll.ps.optimizers import (
    OPTIMIZERS,
    ShardOptimizer,
    check_hyperparameters,
    make_optimizer,
)
from mpicoll.ps.placement import ParamSpec, Placement, specs_from_params
from mpicoll.ps.server import ShardState
from mpicoll.ps.settings import COLOCATED, check_settings


def _specs(**shapes):
    return [ParamSpec(n, s, np.dtype(np.float32)) for n, s in shapes.items()]


def test_placement_is_stable_and_covers_every_element():
    specs = _specs(a=(3,), big=(1000, 3), c=(7, 7), d=(1,))
    p = Placement(specs, 3, split_bytes=4096)
    q = Placement(list(reversed(specs)), 3, split_bytes=4096)
    assert p.describe() == q.describe()                 # independent of order
    assert [sh.server for sh in p.shards["a"]] == [zlib.crc32(b"a") % 3]
    big = p.shards["big"]
    assert [sh.server for sh in big] == [0, 1, 2]
    assert [(sh.lo, sh.hi) for sh in big] == [(0, 1000), (1000, 2000), (2000, 3000)]
    for name, spec in p.specs.items():
        shards = p.shards[name]
        assert shards[0].lo == 0 and shards[-1].hi == spec.size
        assert all(a.hi == b.lo for a, b in zip(shards, shards[1:]))
    assert sum(p.bytes_per_server()) == sum(s.nbytes for s in specs)
    one = Placement(specs, 1, split_bytes=16)
    assert all(len(v) == 1 and v[0].server == 0 for v in one.shards.values())


def test_specs_reject_bad_params():
    with pytest.raises(TypeError, match="dict"):
        specs_from_params([np.zeros(3)])
    with pytest.raises(TypeError, match="not carry"):
        specs_from_params({"x": np.zeros(3, dtype="U3")})
    with pytest.raises(TypeError, match="array"):
        specs_from_params({"x": [1, 2]})
    with pytest.raises(TypeError, match="parameter names must be str, got 3"):
        specs_from_params({3: np.zeros(3)})


def test_placement_detects_key_collisions(monkeypatch):
    import mpicoll.ps.placement as pl
    monkeypatch.setattr(ParamSpec, "key", property(lambda self: 7))
    with pytest.raises(PSError, match="same crc32"):
        pl.Placement(_specs(a=(1,), b=(1,)), 1)


def test_header_fields_and_codes():
    h = P.new_header(P.Op.PUSH, key=123, shard=2, clock=9, seq=77, nbytes=40)
    assert h.dtype == np.int64 and h.size == P.HEADER_LEN
    assert (h[P.OP], h[P.KEY], h[P.SHARD], h[P.CLOCK], h[P.SEQ], h[P.NBYTES]) == \
        (P.Op.PUSH, 123, 2, 9, 77, 40)
    for d in P.DTYPES:
        assert P.dtype_of(P.dtype_code(d)) == d
    assert P.dtype_code(np.dtype("U2")) == -1 and P.dtype_of(-1) is None
    assert P.key_of("w") == zlib.crc32(b"w")
    assert P.shape_code((2, 3)) != P.shape_code((3, 2))
    assert max(P.TAG_REQUEST, P.TAG_REQUEST_DATA, P.TAG_REPLY, P.TAG_REPLY_DATA) < 32767
    assert P.chunk_count(0, 10) == 0 and P.chunk_count(10, 10) == 1 and P.chunk_count(11, 10) == 2


def test_hyperparameter_checks():
    assert check_hyperparameters("sgd", {"lr": 1})["lr"] == 1.0
    with pytest.raises(ValueError, match="optimizer"):
        check_hyperparameters("lion", {})
    with pytest.raises(ValueError, match="unknown hyperparameter"):
        check_hyperparameters("sgd", {"learning_rate": 0.1})
    # out of range, as torch.optim's checks (a NaN was reported as ranks disagreeing,
    # NaN != NaN, although every rank passed it)
    for bad in ({"lr": float("nan")}, {"lr": -0.1}, {"eps": float("inf")},
                {"beta2": 1.0}, {"momentum": -1}):
        with pytest.raises(ValueError, match="must be in"):
            check_hyperparameters("adam", bad)
    with pytest.raises(ValueError, match="number"):
        check_hyperparameters("sgd", {"lr": "0.1"})


_ARGS = dict(num_servers=1, consistency="bsp", staleness=0, optimizer="sgd",
             hyperparameters={}, average=None, split_bytes=64, chunk_bytes=96, init=True,
             restore=None, reshard=False, keep_aggregate=True)


def test_settings_defaults_and_layout():
    s = check_settings(4, **{**_ARGS, "hyperparameters": {"lr": 1}})
    assert s.hyperparameters["lr"] == 1.0 and s.average and not s.colocated
    assert s.first_worker == 1 and s.is_server(0) and not s.is_server(1)
    assert check_settings(4, **{**_ARGS, "optimizer": "sum"}).average is False
    c = check_settings(3, **{**_ARGS, "num_servers": COLOCATED})
    assert c.colocated and c.first_worker == 0 and not c.is_server(0)
    # what ranks compare: plain values only, equal for equal arguments
    assert s.as_plain() == check_settings(4, **{**_ARGS, "hyperparameters": {"lr": 1.0}}
                                          ).as_plain()
    json.dumps(s.as_plain())
    b = check_settings(4, **_ARGS, backup_workers=2)
    assert b.backup_workers == 2 and b.as_plain() != s.as_plain()


@pytest.mark.parametrize("change,fragment", [
    ({"num_servers": 4}, "num_servers=4 must be an int in 1..3"),
    ({"num_servers": True}, "num_servers=True"),
    ({"consistency": "eventual"}, "consistency='eventual'"),
    ({"num_servers": COLOCATED, "consistency": "asp"}, "supports only consistency='bsp'"),
    ({"num_servers": COLOCATED, "init": False}, "needs init=True"),
    ({"staleness": -1}, "staleness=-1"),
    ({"optimizer": "lion"}, "optimizer='lion'"),
    ({"optimizer": "sum", "consistency": "ssp"}, "needs consistency='bsp'"),
    ({"keep_aggregate": False}, "keep_aggregate=False needs"),
    ({"split_bytes": 0}, "must be positive"),
    ({"backup_workers": -1}, "backup_workers=-1 must be an int >= 0"),
    ({"backup_workers": 3}, "must be less than the number of workers (3)"),
    ({"backup_workers": 1, "num_servers": COLOCATED}, "needs separate servers"),
    ({"backup_workers": 1, "consistency": "asp"}, "needs consistency='bsp'"),
    ({"backup_workers": 1, "optimizer": "sum"}, "not optimizer='sum'"),
    ({"local_aggregation": True, "num_servers": 2, "replicas": 1},
     "local_aggregation=True does not work with replicas=1 (failover replays"),
])
def test_settings_errors_name_the_argument(change, fragment):
    with pytest.raises(ValueError) as info:
        check_settings(4, **{**_ARGS, **change})
    assert fragment in str(info.value)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizers_match_hand_written_steps(name):
    hyper = check_hyperparameters(name, {"lr": 0.1, "weight_decay": 0.0})
    opt = make_optimizer(name, 4, np.dtype(np.float64), hyper)
    w = np.array([1.0, -2.0, 0.5, 0.0])
    g = np.array([0.5, 0.25, -1.0, 2.0])
    ref = w.copy()
    m = v = vel = np.zeros(4)
    for t in range(1, 4):
        opt.apply(w, g)
        if name == "sgd":
            ref = ref - 0.1 * g
        elif name == "momentum":
            vel = 0.9 * vel + g
            ref = ref - 0.1 * vel
        elif name == "adam":
            m = 0.9 * m + 0.1 * g
            v = 0.999 * v + 0.001 * g * g
            ref = ref - 0.1 * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.999 ** t)) + 1e-8)
        else:
            ref = g.copy()
        np.testing.assert_allclose(w, ref, rtol=1e-12)
    assert opt.steps == 3


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_applied_in_parts_equals_whole(name):
    """The co-located layout updates a shard segment by segment: bit-identical."""
    hyper = check_hyperparameters(name, {"lr": 0.1, "weight_decay": 0.01})
    whole, parts = (make_optimizer(name, 7, np.dtype(np.float32), hyper) for _ in range(2))
    w1 = np.linspace(-1, 1, 7).astype(np.float32)
    w2 = w1.copy()
    for t in range(3):
        g = np.cos(np.arange(7) + t).astype(np.float32)
        whole.apply(w1, g)
        parts.begin_update()
        for lo, hi in ((0, 3), (3, 4), (4, 7)):
            parts.apply_part(w2[lo:hi], g[lo:hi], lo, hi)
        np.testing.assert_array_equal(w2, w1)
    assert parts.steps == whole.steps == 3


def test_shard_optimizer_base_has_no_rule():
    """The base class is an interface: applying it raises NotImplementedError."""
    with pytest.raises(NotImplementedError):
        ShardOptimizer(3, np.dtype(np.float32), {}).apply(np.zeros(3), np.ones(3))


def test_atomic_write_failure_leaves_the_old_file(tmp_path, monkeypatch):
    """A write that fails midway raises its own error, removes its temporary file (even
    when that is already gone) and leaves the previous file in place."""
    target = tmp_path / "f"
    target.write_bytes(b"old")

    def broken(f):
        f.write(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ckpt._atomic_write(str(target), broken)
    assert sorted(os.listdir(tmp_path)) == ["f"] and target.read_bytes() == b"old"

    def gone(path):
        raise FileNotFoundError(path)

    monkeypatch.setattr(ckpt.os, "unlink", gone)
    with pytest.raises(OSError, match="disk full"):
        ckpt._atomic_write(str(target), broken)
    assert target.read_bytes() == b"old"


def test_remove_stale_ignores_files_already_gone(tmp_path, monkeypatch):
    """Another process may delete a stale file first: remove_stale goes on."""
    (tmp_path / "ckpt-a.server0.npz").write_bytes(b"x")
    tried = []

    def gone(path):
        tried.append(os.path.basename(path))
        raise FileNotFoundError(path)

    monkeypatch.setattr(ckpt.os, "unlink", gone)
    ckpt.remove_stale(str(tmp_path), "ckpt-b")
    assert tried == ["ckpt-a.server0.npz"]


def test_checkpoint_loader_refuses_incomplete_checkpoints(tmp_path):
    """A shard saved before it was initialized, or a checkpoint that does not cover a
    shard's range, raises ValueError saying which."""
    spec = ParamSpec("w", (4,), np.dtype(np.float64))
    hyper = check_hyperparameters("sgd", {})
    place = Placement([spec], 1)
    sh = place.shards["w"][0]
    ckpt.write_server_file(str(tmp_path), "c", 0, [ShardState(sh, "sgd", hyper, [1])])
    manifest = {"format": ckpt.FORMAT, "id": "c", "layout": place.describe()}
    loader = ckpt.ShardLoader(str(tmp_path), manifest)
    with pytest.raises(ValueError, match="'w' was not initialized when the checkpoint"):
        loader.load(ShardState(sh, "sgd", hyper, [1]), None)
    loader.close()
    manifest["layout"] = {**manifest["layout"], "shards": []}
    loader = ckpt.ShardLoader(str(tmp_path), manifest)
    with pytest.raises(ValueError, match="checkpoint covers 0 of 4 elements"):
        loader.load(ShardState(sh, "sgd", hyper, [1]), None)
    loader.close()


def test_checkpoint_files_roundtrip_and_reshard(tmp_path):
    spec = ParamSpec("w", (10,), np.dtype(np.float64))
    hyper = check_hyperparameters("momentum", {})
    old = Placement([spec], 2, split_bytes=8)
    states = {}
    for s in range(2):
        states[s] = []
        for sh in old.shards_on(s):
            st = ShardState(sh, "momentum", hyper, [2, 3])
            st.initialize(np.arange(sh.lo, sh.hi, dtype=np.float64))
            st.opt.state["velocity"][:] = -np.arange(sh.lo, sh.hi)
            st.version = st.opt.steps = 5
            st.clocks = {2: 5, 3: 4}
            states[s].append(st)
            ckpt.write_server_file(str(tmp_path), "ckpt-x", s, states[s])
    manifest = {"format": ckpt.FORMAT, "id": "ckpt-x", "layout": old.describe()}
    ckpt.write_manifest(str(tmp_path), manifest)
    assert ckpt.read_manifest(str(tmp_path))["id"] == "ckpt-x"
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]
    # restore into 3 servers (different ranges) and 1 server
    for k in (3, 1):
        new = Placement([spec], k, split_bytes=8)
        loader = ckpt.ShardLoader(str(tmp_path), manifest)
        for sh in (s for srv in range(k) for s in new.shards_on(srv)):
            st = ShardState(sh, "momentum", hyper, [2, 3])
            loader.load(st, None)
            np.testing.assert_array_equal(st.param, np.arange(sh.lo, sh.hi))
            np.testing.assert_array_equal(st.opt.state["velocity"], -np.arange(sh.lo, sh.hi))
            assert st.version == 5 and st.opt.steps == 5 and st.clocks == {2: 5, 3: 4}
        loader.close()
    (tmp_path / "ckpt-old.server0.npz").write_bytes(b"x")
    ckpt.remove_stale(str(tmp_path), "ckpt-x")
    assert sorted(os.listdir(tmp_path)) == ["ckpt-x.server0.npz", "ckpt-x.server1.npz",
                                            "manifest.json"]
    manifest["format"] = "other"
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="format"):
        ckpt.read_manifest(str(tmp_path))


def test_backoff_sleeps_after_spinning(monkeypatch):
    slept = []
    monkeypatch.setattr(P.time, "sleep", slept.append)
    b = P.Backoff(spin=2, first_sleep=1e-5, max_sleep=4e-5)
    for _ in range(6):
        b.pause()
    assert slept == [1e-5, 2e-5, 4e-5, 4e-5]
    b.reset()
    b.pause()
    assert len(slept) == 4


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 300), min_size=1, max_size=6),
       servers=st.integers(1, 5), split=st.integers(1, 2000))
def test_placement_property_every_element_once(sizes, servers, split):
    specs = [ParamSpec(f"p{i}", (n,), np.dtype(np.float32)) for i, n in enumerate(sizes)]
    p = Placement(specs, servers, split_bytes=split)
    for spec in specs:
        covered = np.zeros(spec.size, dtype=int)
        for sh in p.shards[spec.name]:
            assert 0 <= sh.server < servers
            covered[sh.lo:sh.hi] += 1
        assert (covered == 1).all()
        if len(p.shards[spec.name]) > 1:
            assert spec.nbytes >= split
    assert sum(p.bytes_per_server()) == sum(s.nbytes for s in specs)
    assert Placement(list(reversed(specs)), servers, split).describe() == p.describe()


def test_checkpoint_reshard_with_empty_shards(tmp_path):
    """A 3-element tensor split over 5 servers has empty shards; restore into 2 and 4."""
    spec = ParamSpec("t", (3,), np.dtype(np.float64))
    empty = ParamSpec("e", (0,), np.dtype(np.float64))
    hyper = check_hyperparameters("adam", {})
    old = Placement([spec, empty], 5, split_bytes=8)
    for s in range(5):
        states = []
        for sh in old.shards_on(s):
            st = ShardState(sh, "adam", hyper, [5])
            st.initialize(np.arange(sh.lo, sh.hi, dtype=np.float64) + 0.5)
            st.version = st.opt.steps = 2
            st.clocks = {5: 2}
            states.append(st)
        ckpt.write_server_file(str(tmp_path), "c", s, states)
    manifest = {"format": ckpt.FORMAT, "id": "c", "layout": old.describe()}
    for k in (2, 4):
        new = Placement([spec, empty], k, split_bytes=8)
        loader = ckpt.ShardLoader(str(tmp_path), manifest)
        for sh in (s for srv in range(k) for s in new.shards_on(srv)):
            st = ShardState(sh, "adam", hyper, [5])
            loader.load(st, None)
            np.testing.assert_array_equal(st.param, np.arange(sh.lo, sh.hi) + 0.5)
            assert st.version == 2 and st.clocks == {5: 2}
        loader.close()


def test_backoff_yields_while_busy_then_sleeps(monkeypatch):
    slept, yielded = [], []
    monkeypatch.setattr(P.time, "sleep", slept.append)
    monkeypatch.setattr(P.os, "sched_yield", lambda: yielded.append(1))
    now = [100.0]
    monkeypatch.setattr(P.time, "monotonic", lambda: now[0])
    b = P.Backoff(spin=0, first_sleep=1e-5, busy_window=0.1)
    b.pause(busy=True)
    assert yielded == [1] and slept == []
    now[0] += 0.2                     # no progress for longer than the window
    b.pause(busy=True)
    assert yielded == [1] and slept == [1e-5]
