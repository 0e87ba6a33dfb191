"""Units of mpicoll.torch.local_sgd (no MPI): the settings' checks, the step plans of
local and hierarchical SGD with a warm-up, and which optimizer state is averaged."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mpicoll.torch.local_sgd import (NODE, NONE, WORLD, LocalSGDSchedule,  # noqa: E402
                                     LocalSGDSettings, check_settings, layout_of,
                                     state_tensors)


def _plans(steps: int, **settings) -> list[tuple[int, int, int]]:
    schedule = LocalSGDSchedule(check_settings(**settings))
    return [tuple(schedule.advance())[1:] for _ in range(steps)]


def test_defaults_are_ordinary_training():
    settings = check_settings()
    assert settings == LocalSGDSettings(1, None, 0, True) and not settings.enabled
    # every step averages the gradients over every rank, never the parameters
    assert _plans(5) == [(WORLD, WORLD, NONE)] * 5
    assert check_settings(sync_every=1, warmup_steps=3).enabled is False


def test_local_sgd_plan():
    # (level, gradients averaged over, parameters averaged over) per step
    assert _plans(7, sync_every=3) == [
        (NONE, NONE, NONE), (NONE, NONE, NONE), (WORLD, NONE, WORLD),
        (NONE, NONE, NONE), (NONE, NONE, NONE), (WORLD, NONE, WORLD), (NONE, NONE, NONE)]


def test_warmup_then_local():
    assert _plans(6, sync_every=2, warmup_steps=3) == [
        (WORLD, WORLD, NONE)] * 3 + [(NONE, NONE, NONE), (WORLD, NONE, WORLD),
                                     (NONE, NONE, NONE)]


def test_hierarchical_every_step_in_the_node():
    # M = 1: the node's replicas stay equal, so their gradients are averaged (no
    # parameter average inside the node); every 4th step the parameters over every rank
    assert _plans(9, sync_every=4, node_sync_every=1) == [
        (NODE, NODE, NONE), (NODE, NODE, NONE), (NODE, NODE, NONE), (WORLD, NONE, WORLD),
        (NODE, NODE, NONE), (NODE, NODE, NONE), (NODE, NODE, NONE), (WORLD, NONE, WORLD),
        (NODE, NODE, NONE)]


def test_hierarchical_periods():
    levels = [plan[0] for plan in _plans(12, sync_every=6, node_sync_every=4,
                                         warmup_steps=1)]
    # step 1 warm-up; then local step j = k - 1: world at j % 6 == 0, node at j % 4 == 0
    assert levels == [WORLD, NONE, NONE, NONE, NODE, NONE, WORLD, NONE, NODE, NONE, NONE,
                      NONE]
    plans = _plans(12, sync_every=6, node_sync_every=4, warmup_steps=1)
    assert plans[4] == (NODE, NONE, NODE) and plans[6] == (WORLD, NONE, WORLD)


def test_schedule_state_round_trip():
    schedule = LocalSGDSchedule(check_settings(sync_every=3, node_sync_every=1))
    for _ in range(4):
        schedule.advance()
    other = LocalSGDSchedule(check_settings(sync_every=3, node_sync_every=1))
    other.load_state_dict(schedule.state_dict())
    assert [other.advance() for _ in range(5)] == [schedule.advance() for _ in range(5)]


@pytest.mark.parametrize("bad, kind, match", [
    (dict(sync_every=0), ValueError, "sync_every must be an int >= 1"),
    (dict(sync_every=True), TypeError, "sync_every must be an int"),
    (dict(sync_every="4"), TypeError, "sync_every must be an int"),
    (dict(sync_every=4, node_sync_every=0), ValueError, "node_sync_every must be"),
    (dict(sync_every=4, node_sync_every=4), ValueError, "smaller than sync_every"),
    (dict(sync_every=1, node_sync_every=1), ValueError, "smaller than sync_every"),
    (dict(sync_every=4, warmup_steps=-1), ValueError, "warmup_steps must be"),
    (dict(sync_every=4, warmup_steps=1.5), TypeError, "warmup_steps must be an int"),
    (dict(sync_every=4, average_state=1), TypeError, "average_state must be a bool"),
])
def test_bad_settings(bad, kind, match):
    with pytest.raises(kind, match=match):
        check_settings(**bad)


def test_state_tensors_pick_parameter_shaped_float_state():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1, amsgrad=True)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    picked = state_tensors(opt, list(model.parameters()))
    expected = [opt.state[p][k] for p in model.parameters()
                for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")]
    assert len(picked) == 6 and all(a is b for a, b in zip(picked, expected))
    # the step counters are not averaged; SGD without momentum has no state
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    plain.step()
    assert state_tensors(plain, list(model.parameters())) == []
    # a one-element parameter's momentum is averaged, its step counter (Adam) is not
    scalar = torch.nn.Parameter(torch.ones(1))
    adam = torch.optim.Adam([scalar], lr=0.1)
    scalar.grad = torch.ones(1)
    adam.step()
    assert [t is adam.state[scalar]["exp_avg"] for t in state_tensors(adam, [scalar])] == \
        [True, False]


def test_layout_fingerprint_sees_shapes_and_dtypes():
    a = [torch.zeros(2, 3), torch.zeros(4)]
    assert layout_of(a) == layout_of([torch.ones(2, 3), torch.ones(4)])
    assert layout_of(a) != layout_of([torch.zeros(3, 2), torch.zeros(4)])
    assert layout_of(a) != layout_of([torch.zeros(2, 3, dtype=torch.float64), torch.zeros(4)])
