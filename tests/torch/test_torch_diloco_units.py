"""Units of DiLoCo (issue 35) in one process: the settings' checks, the fragment layout
and step schedule (:mod:`mpicoll.torch.diloco_plan`), the 4-bit codec
(:mod:`mpicoll.compression.int4`), and :class:`mpicoll.torch.DiLoCo` on a world of one
rank (argument errors, the outer step, gradients left alone, per-fragment outer
optimizers, checkpoints, close)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mpicoll import compression  # noqa: E402
from mpicoll.compression.codecs import new_payload  # noqa: E402
from mpicoll.compression import Int4Codec, get_codec  # noqa: E402
from mpicoll.runtime import comms  # noqa: E402
from mpicoll.torch.diloco import DiLoCo  # noqa: E402
from mpicoll.torch.diloco_plan import (DiLoCoSchedule, DiLoCoSettings,  # noqa: E402
                                       balanced_runs, check_settings, fragment_sizes)


# ---------------------------------------------------------------------------- settings
def test_settings_defaults_and_period():
    s = check_settings(8)
    assert s == DiLoCoSettings(8, 1, 0, 0.5) and s.period == 8
    assert check_settings(12, 4, 2, 1).period == 3


@pytest.mark.parametrize("args, error, message", [
    ((6, 4), ValueError, r"sync_every \(6\) must be a multiple of fragments \(4\)"),
    ((8, 4, 2), ValueError, r"overlap \(2\) must be smaller than sync_every / fragments "
                            r"\(8 / 4 = 2\)"),
    ((4, 1, 4), ValueError, "overlap"),
    ((0,), ValueError, "sync_every must be an int >= 1, not 0"),
    ((4, 0), ValueError, "fragments must be an int >= 1"),
    ((4, 1, -1), ValueError, "overlap must be an int >= 0"),
    ((4, 1, 0, -0.1), ValueError, r"alpha must be in \[0, 1\]"),
    ((4, 1, 0, float("nan")), ValueError, "alpha"),
    ((4.0,), TypeError, "sync_every must be an int"),
    ((True,), TypeError, "sync_every must be an int"),
    ((4, 1, 0, "0.5"), TypeError, "alpha must be a float"),
])
def test_bad_settings(args, error, message):
    with pytest.raises(error, match=message):
        check_settings(*args)


# ---------------------------------------------------------------------------- layout
def test_balanced_runs_nearest_cuts():
    sizes = [30, 6, 24, 4, 12, 3]                       # running 30 36 60 64 76 79
    assert balanced_runs(sizes, 4) == [(0, 1), (1, 2), (2, 3), (3, 6)]
    assert balanced_runs(sizes, 2) == [(0, 2), (2, 6)]  # 36 is nearest 39.5
    assert balanced_runs(sizes, 1) == [(0, 6)]
    assert balanced_runs(sizes, 6) == [(i, i + 1) for i in range(6)]
    assert fragment_sizes(balanced_runs(sizes, 2), sizes) == [36, 43]


def test_balanced_runs_properties():
    rng = np.random.default_rng(5)
    for _ in range(200):
        sizes = list(rng.integers(1, 1000, rng.integers(1, 12)))
        for f in range(1, len(sizes) + 1):
            runs = balanced_runs(sizes, f)
            assert len(runs) == f and runs[0][0] == 0 and runs[-1][1] == len(sizes)
            assert all(a < b for a, b in runs)
            assert all(runs[i][1] == runs[i + 1][0] for i in range(f - 1))
    # one large tensor cannot be split: the others share the rest
    assert balanced_runs([1, 1000, 1, 1], 3) == [(0, 1), (1, 2), (2, 4)]
    with pytest.raises(ValueError, match="must not exceed the number of parameter tensors"):
        balanced_runs([5, 5], 3)


# ---------------------------------------------------------------------------- schedule
def _events(schedule: DiLoCoSchedule, steps: int):
    return ([(t, schedule.sends(t)) for t in range(1, steps + 1)
             if schedule.sends(t) is not None],
            [(t, schedule.arrives(t)) for t in range(1, steps + 1)
             if schedule.arrives(t) is not None])


def test_schedule_algorithm1():
    sends, arrivals = _events(DiLoCoSchedule(check_settings(4)), 12)
    assert sends == arrivals == [(4, 0), (8, 0), (12, 0)]


def test_schedule_streaming_staggered_and_overlapped():
    schedule = DiLoCoSchedule(check_settings(8, 4, 1))
    sends, arrivals = _events(schedule, 17)
    assert arrivals == [(2, 0), (4, 1), (6, 2), (8, 3), (10, 0), (12, 1), (14, 2), (16, 3)]
    assert sends == [(1, 0), (3, 1), (5, 2), (7, 3), (9, 0), (11, 1), (13, 2), (15, 3),
                     (17, 0)]
    assert [schedule.syncs_of(p, 16) for p in range(4)] == [2, 2, 2, 2]
    assert [schedule.syncs_of(p, 5) for p in range(4)] == [1, 1, 0, 0]
    assert schedule.next_arrival(5) == 6 and schedule.next_arrival(6) == 8


def test_schedule_one_in_flight_at_most():
    for h, f, tau in [(8, 4, 1), (12, 3, 3), (10, 1, 9), (6, 6, 0)]:
        schedule = DiLoCoSchedule(check_settings(h, f, tau))
        in_flight = None
        for t in range(1, 5 * h):
            sent, arrived = schedule.sends(t), schedule.arrives(t)
            if sent is not None:
                assert in_flight is None
                in_flight = sent
            if arrived is not None:
                assert arrived == in_flight
                in_flight = None


# ---------------------------------------------------------------------------- int4
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("count", [0, 1, 7, 8, 9, 255, 256, 257, (1 << 17) + 3])
def test_int4_round_trip_bound(dtype, count):
    codec = Int4Codec()
    x = np.random.default_rng(count).standard_normal(count).astype(dtype) * 3
    payload = codec.encode(x)
    assert [a.dtype for a in payload] == [np.float32, np.uint8]
    assert payload[1].size == (count + 1) // 2 and payload[0].size == -(-count // 256)
    assert codec.wire_bytes(count, dtype) == (count + 1) // 2 + 4 * (-(-count // 256))
    y = codec.decode(payload, count, dtype)
    assert y.dtype == dtype
    if count:
        scale = np.repeat(payload[0], 256)[:count].astype(np.float64)
        assert np.all(np.abs(y - x) <= scale / 2 * (1 + 1e-6) + 1e-30)
        # the chunk maximum is a level: exact up to float32 rounding of the scale
        i = int(np.argmax(np.abs(x[:256])))
        assert abs(y[i] - x[i]) <= 1e-6 * abs(x[i])


def test_int4_levels_and_wire_format():
    codec = Int4Codec(chunk=8)
    x = np.array([7, -7, 3.5, 1, 0, -0.5, 2, 6, 100], dtype=np.float32)
    scales, packed = codec.encode(x)
    assert np.allclose(scales, [1.0, 100 / 7])
    # nibble = q + 8, element 2i low, 2i+1 high; 3.5 rounds half to even (4), -0.5 to -0
    q = [7, -7, 4, 1, 0, 0, 2, 6, 7]
    nib = [v + 8 for v in q] + [8]
    assert list(packed) == [nib[2 * i] | (nib[2 * i + 1] << 4) for i in range(5)]
    assert np.array_equal(codec.roundtrip(x)[:8], np.array(q[:8], dtype=np.float32))
    assert np.array_equal(codec.roundtrip(np.zeros(5, np.float32)), np.zeros(5, np.float32))
    # the same bits through a caller's payload buffer
    raw, parts = new_payload(codec, x.size, np.float32)
    codec.encode(x, out=parts)
    assert np.array_equal(codec.decode_into(raw, x.size, np.empty(9, np.float32)),
                          codec.roundtrip(x))


def test_int4_error_feedback_identity():
    codec = Int4Codec(chunk=16)
    fb = compression.ErrorFeedback()
    rng = np.random.default_rng(1)
    carried = np.zeros(100)
    for _ in range(5):
        x = rng.standard_normal(100)
        y = x + carried
        sent = codec.decode(fb.encode(codec, x, key="g"), 100, np.float64)
        carried = fb.residual("g").copy()
        assert np.allclose(sent + carried, y, rtol=0, atol=1e-12)


def test_int4_names_and_errors():
    assert get_codec("int4").name == "int4"
    assert get_codec("INT4:64").chunk == 64 and get_codec("int4:64").name == "int4:64"
    assert get_codec("int8").name == "int8"
    with pytest.raises(ValueError, match="unknown option"):
        get_codec("int4:two")
    with pytest.raises(ValueError, match="chunk must be even"):
        Int4Codec(chunk=7)
    with pytest.raises(TypeError, match="needs float32 or float64"):
        Int4Codec().encode(np.arange(4))


def test_int4_in_the_compressed_allreduce_of_one_rank():
    x = np.linspace(-1, 1, 37)
    fb = compression.ErrorFeedback()
    out = compression.allreduce(x, op="average", compression=Int4Codec(), feedback=fb,
                                key="k")
    assert np.allclose(out + fb.residual("k"), x, atol=1e-12)
    assert compression.last_stats().codec == "int4"


# ---------------------------------------------------------------------------- DiLoCo, n = 1
def _model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(),
                               torch.nn.Linear(5, 2)).double()


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(6, 4, generator=g, dtype=torch.float64), \
        torch.randn(6, 2, generator=g, dtype=torch.float64)
    return ((model(x) - y) ** 2).mean()


def _make(model, outer_lr=0.7, momentum=0.9, **kwargs) -> DiLoCo:
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=outer_lr, momentum=momentum,
                            nesterov=momentum > 0)
    return DiLoCo(model, inner, outer, **kwargs)


def _run(d: DiLoCo, first: int, last: int) -> None:
    for step in range(first, last + 1):
        d.zero_grad()
        _loss(d.model, step).backward()
        d.step()


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def test_outer_sgd_lr1_is_local_training():
    """One rank, outer SGD with lr 1 and no momentum: θ_g - 1 (θ_g - θ_local) = θ_local, so
    DiLoCo trains like its inner optimizer alone."""
    plain = _model()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(1, 9):
        opt.zero_grad()
        _loss(plain, step).backward()
        opt.step()
    with _make(_model(), outer_lr=1.0, momentum=0.0, sync_every=4) as d:
        _run(d, 1, 8)
        assert d.stats()["outer_steps"] == [2]
        assert torch.allclose(_flat(d.global_parameters()), _flat(plain.parameters()),
                              rtol=0, atol=1e-14)
        assert torch.equal(_flat(d.global_parameters()), _flat(d.model.parameters()))


def test_between_syncs_global_stays_and_gradients_are_left_alone():
    model = _model()
    with _make(model, sync_every=4, fragments=2, overlap=1) as d:
        start = _flat(d.global_parameters()).clone()
        d.zero_grad()
        _loss(model, 1).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        d.step()                                    # step 1 sends fragment 0
        assert d.in_flight() == 0 and torch.equal(_flat(d.global_parameters()), start)
        d.zero_grad()
        _loss(model, 2).backward()
        grads = [p.grad for p in model.parameters()]
        d.step()                                    # step 2: fragment 0's outer step
        assert d.in_flight() is None and d.stats()["outer_steps"] == [1, 0]
        assert all(p.grad is g for p, g in zip(model.parameters(), grads))
        theta = _flat(d.global_parameters())
        assert not torch.equal(theta[:25], start[:25])      # fragment 0 (Linear(4, 5))
        assert torch.equal(theta[25:], start[25:])


def test_outer_optimizer_per_fragment():
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outers = [torch.optim.SGD(list(model[0].parameters()), lr=0.5),
              torch.optim.SGD(list(model[2].parameters()), lr=0.5)]
    with DiLoCo(model, inner, outers, sync_every=2, fragments=[model[0], model[2]]) as d:
        assert d.members == [[0, 1], [2, 3]]
        _run(d, 1, 4)
        assert d.stats()["outer_steps"] == [2, 2]
        assert all(len(o.state) == 0 for o in outers)       # plain SGD keeps no state


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(fragments=[]), ValueError, "must not be an empty list"),
    (dict(fragments=["x"]), TypeError, r"fragments\[0\] must be an nn.Module"),
    (dict(fragments=[torch.nn.Linear(2, 2)]), ValueError, "not the model's"),
    (dict(fragments="model"), TypeError, "fragments must be an int"),
    (dict(compression="lz4"), ValueError, "unknown compression"),
    (dict(comm=3), TypeError, "comm must be an mpi4py intracommunicator"),
])
def test_argument_errors(kwargs, error, message):
    model = _model()
    before = len(comms.alive())
    with pytest.raises(error, match=message):
        _make(model, sync_every=4, **kwargs)
    assert len(comms.alive()) == before


def test_module_fragments_must_partition_the_model():
    model = _model()
    with pytest.raises(ValueError, match=r"leave out parameters \[2, 3\]"):
        _make(model, sync_every=4, fragments=[model[0]])
    with pytest.raises(ValueError, match="share a parameter"):
        _make(model, sync_every=4, fragments=[model, model[0]])
    with pytest.raises(ValueError, match="has no parameters"):
        _make(model, sync_every=4, fragments=[model, model[1]])


def test_dtype_errors():
    with pytest.raises(TypeError, match="float16, float32 and float64"):
        _make(_model().to(torch.bfloat16), sync_every=2)
    with pytest.raises(TypeError, match="needs float32 or float64"):
        _make(_model().half(), sync_every=2, compression="int8")


def test_state_dict_round_trip_and_close():
    model = _model()
    with _make(model, sync_every=4, fragments=2, overlap=1, compression="int4") as d:
        _run(d, 1, 5)                                  # step 5 sends fragment 0
        assert d.in_flight() == 0
        saved = (d.state_dict(), {k: v.clone() for k, v in model.state_dict().items()},
                 d.inner_optimizer.state_dict())
        import copy
        saved = copy.deepcopy(saved)
        assert saved[0]["steps"] == 5 and saved[0]["pending"]["fragment"] == 0
        assert set(saved[0]["residuals"]) == {"fragment0.float64", "fragment1.float64"}
        _run(d, 6, 11)
        want = (_flat(d.global_parameters()).clone(), _flat(model.parameters()).clone())
    assert comms.record_of(d.comm) is None               # freed by close()
    with pytest.raises(RuntimeError, match="after close"):
        d.step()
    d.close()                                            # idempotent
    model2 = _model(seed=3)
    with _make(model2, sync_every=4, fragments=2, overlap=1, compression="int4") as d2:
        model2.load_state_dict(saved[1])
        d2.inner_optimizer.load_state_dict(saved[2])
        d2.load_state_dict(saved[0])
        _run(d2, 6, 11)
        assert torch.equal(_flat(d2.global_parameters()), want[0])
        assert torch.equal(_flat(model2.parameters()), want[1])
        with pytest.raises(ValueError, match="not a DiLoCo state_dict"):
            d2.load_state_dict({})
    with _make(_model(), sync_every=4) as d3:
        with pytest.raises(ValueError, match="other settings"):
            d3.load_state_dict(saved[0])


def test_model_and_optimizer_type_errors():
    """What is not a module, an optimizer, or as many outer optimizers as fragments (or
    one), and a model without parameters, are refused naming the argument."""
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.7)
    with pytest.raises(TypeError, match="model must be an nn.Module, not list"):
        DiLoCo([model], inner, outer, sync_every=4)
    with pytest.raises(TypeError, match="inner_optimizer must be a torch.optim.Optimizer, "
                                        "not dict"):
        DiLoCo(model, {}, outer, sync_every=4)
    with pytest.raises(ValueError, match="a list of 2 optimizers for 3 fragments"):
        DiLoCo(model, inner, [outer, outer], sync_every=3, fragments=3)
    with pytest.raises(ValueError, match="the model has no parameters"):
        DiLoCo(torch.nn.Tanh(), inner, outer, sync_every=4)


def test_load_state_dict_while_an_exchange_is_in_flight():
    """Loading a state while a fragment's exchange is in flight waits for it first; the
    state saved at that very point, loaded there, changes nothing: training goes on as
    without the load."""
    with _make(_model(), sync_every=4, fragments=2, overlap=1) as ref:
        _run(ref, 1, 11)
        want = _flat(ref.global_parameters()).clone()
    with _make(_model(), sync_every=4, fragments=2, overlap=1) as d:
        _run(d, 1, 5)
        assert d.in_flight() == 0
        import copy
        d.load_state_dict(copy.deepcopy(d.state_dict()))
        _run(d, 6, 11)
        assert torch.equal(_flat(d.global_parameters()), want)



FOLLOW_WORLD = """
import torch
from mpicoll import context
from mpicoll.runtime import comms
from mpicoll.torch.diloco import DiLoCo


def run(change, restore=True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(),
                                torch.nn.Linear(5, 2)).double()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.7)
    with DiLoCo(model, inner, outer, sync_every=4, fragments=2, overlap=1) as d:
        for k in range(1, 6):
            g = torch.Generator().manual_seed(k)
            d.zero_grad()
            (model(torch.randn(6, 4, generator=g, dtype=torch.float64)) ** 2).mean().backward()
            d.step()
            if k == 1 and change:            # fragment 0's all-reduce in flight
                assert d.in_flight() == 0
                lane, comm = d._lane, d.comm
                commit = d.state_dict()
                context.set_world(None)      # a new world generation (an elastic reset's)
                if not restore:              # stepping on: the exchange in flight is dropped
                    continue
                d.load_state_dict(commit)    # the elastic restore: moves to the new world
                assert lane._closed and lane._thread is None, "the old lane still runs"
                assert comms.record_of(comm) is None and d.comm is not comm
                assert d._lane is not None and d._lane is not lane and d.in_flight() == 0
        assert d.stats()["outer_steps"] == ([1, 1] if restore else [0, 1]), d.stats()
        return torch.cat([p.detach().reshape(-1) for p in d.global_parameters()])


assert torch.equal(run(True), run(False))
assert not torch.equal(run(True, restore=False), run(False))
print("FOLLOWED")
"""


def test_a_new_world_closes_the_overlap_lane():
    """DiLoCo with ``overlap`` follows a new world generation (in a process of its own: a
    new generation releases the old world's communicators): at the elastic restore the
    overlap lane and the duplicate of the old world are closed and freed, the committed
    exchange goes on, and training ends as without the change. Stepping on without the
    restore skips the dropped exchange's outer step (it raised TypeError before)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", FOLLOW_WORLD], capture_output=True,
                          text=True, timeout=120, cwd=root, check=False)
    assert done.returncode == 0 and "FOLLOWED" in done.stdout, done.stdout + done.stderr
