"""DiLoCo and Streaming DiLoCo (issue 35): ``mpicoll.torch.DiLoCo``.

Every rank trains on its own data (seeded by rank and step), so replicas differ between
syncs. Checked at every world size: the trajectory (``θ_g`` and this rank's parameters
after every inner step) equals an independent float64 reference that simulates every rank
in one process (DiLoCo's Algorithm 1, and the streaming variant with 4 fragments and an
overlap of 1, balanced or given as modules) to 1e-10; ``θ_g`` is bitwise equal on every
rank after every outer step (also compressed, with error feedback); a rank that averaged
only its own pseudo-gradient would be far from the reference; bad or disagreeing settings
raise ``ValueError`` on every rank; ``state_dict`` taken while an all-reduce is in flight
resumes to the same bits.
"""
from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

import mpicoll.torch as hvd
from mpicoll.context import get_context
from mpicoll.runtime import comms, progress

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
LR, MOMENTUM = 0.05, 0.9
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
TOL = 1e-10


def _model() -> torch.nn.Sequential:
    torch.manual_seed(11 + RANK)          # different on every rank: DiLoCo broadcasts rank 0's
    return torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 4),
                               torch.nn.Tanh(), torch.nn.Linear(4, 3)).double()


def _loss(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7919 * rank + step)
    x = torch.randn(8, 5, generator=gen, dtype=torch.float64)
    y = torch.randn(8, 3, generator=gen, dtype=torch.float64)
    return ((model(x) - y) ** 2).mean()


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).clone() for t in tensors])


def _same_everywhere(t: torch.Tensor) -> list[bool]:
    every = COMM.allgather(t.numpy().tobytes())
    return [other == every[RANK] for other in every]


def _diloco(model: torch.nn.Module, **kwargs) -> hvd.DiLoCo:
    inner = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM,
                            nesterov=True)
    return hvd.DiLoCo(model, inner, outer, **kwargs)


def _train(d: hvd.DiLoCo, first: int, last: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inner steps ``first .. last``; (θ_g, this rank's parameters) after each."""
    out = []
    for step in range(first, last + 1):
        d.zero_grad()
        _loss(d.model, RANK, step).backward()
        d.step()
        out.append((_flat(d.global_parameters()), _flat(d.model.parameters())))
    return out


def reference(sync_every: int, fragments: list[list[int]], overlap: int, alpha: float,
              steps: int, ranks: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(θ_g, this rank's parameters) after each inner step, every rank of ``ranks``
    simulated in float64 in one process: momentum SGD on each rank's own data; fragment
    ``p`` arrives after steps ``(p + 1) H / F + k H`` and is sent ``overlap`` steps
    earlier (its pseudo-gradient θ_g - θ_r then, summed in rank order, divided by the
    ranks); on arrival Nesterov SGD written out by hand (torch's formulation:
    ``b = m b + g`` (``b = g`` the first time), ``θ -= lr (g + m b)``) takes θ_g's step,
    and every rank's parameters become θ_g, or ``θ_g + alpha (θ_r - θ_g)`` with overlap."""
    first = _model_with_seed(11)
    models = [_model_with_seed(11) for _ in ranks]
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM) for m in models]
    theta = [p.detach().clone() for p in first.parameters()]
    buffers: list[torch.Tensor | None] = [None] * len(theta)
    h = sync_every // len(fragments)
    arrivals = {(p + 1) * h + k * sync_every: p for p in range(len(fragments))
                for k in range(steps // sync_every + 1)}
    sends = {t - overlap: p for t, p in arrivals.items()}
    pending = None
    out = []
    me = ranks.index(RANK) if RANK in ranks else 0
    for step in range(1, steps + 1):
        for r, m, o in zip(ranks, models, opts):
            o.zero_grad()
            _loss(m, r, step).backward()
            o.step()
        params = [list(m.parameters()) for m in models]
        if step in sends:
            p = sends[step]
            mean = {}
            for i in fragments[p]:
                total = torch.zeros_like(theta[i])
                for ps in params:
                    total = total + (theta[i] - ps[i].detach())
                mean[i] = total / len(ranks)
            pending = (p, mean)
        if step in arrivals:
            p, mean = pending
            assert p == arrivals[step]
            with torch.no_grad():
                for i in fragments[p]:
                    g = mean[i]
                    buffers[i] = g.clone() if buffers[i] is None else \
                        OUTER_MOMENTUM * buffers[i] + g
                    theta[i] = theta[i] - OUTER_LR * (g + OUTER_MOMENTUM * buffers[i])
                    for ps in params:
                        if overlap == 0:
                            ps[i].copy_(theta[i])
                        else:
                            ps[i].copy_(theta[i] + alpha * (ps[i] - theta[i]))
        out.append((_flat(theta), _flat(params[me])))
    return out


def _model_with_seed(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 4),
                               torch.nn.Tanh(), torch.nn.Linear(4, 3)).double()


def _max_error(got, want) -> float:
    return max(max(float((a - b).abs().max()), float((c - d).abs().max()))
               for (a, c), (b, d) in zip(got, want))


#: The model's 6 tensors hold 30, 6, 24, 4, 12, 3 elements (79): cut at the running
#: counts nearest 79/4, 79/2, 3*79/4.
BALANCED_4 = [[0], [1], [2], [3, 4, 5]]


@pytest.mark.parametrize("case", [
    dict(sync_every=4, fragments=1, overlap=0, steps=12, members=[[0, 1, 2, 3, 4, 5]]),
    dict(sync_every=8, fragments=4, overlap=1, steps=24, members=BALANCED_4),
    dict(sync_every=8, fragments=4, overlap=0, steps=16, members=BALANCED_4),
], ids=["algorithm1_H4", "streaming_F4_tau1", "streaming_F4_tau0"])
def test_matches_float64_reference(hvd, case):
    model = _model()
    d = _diloco(model, sync_every=case["sync_every"], fragments=case["fragments"],
                overlap=case["overlap"], alpha=0.5)
    try:
        assert d.members == case["members"]
        got = _train(d, 1, case["steps"])
        want = reference(case["sync_every"], case["members"], case["overlap"], 0.5,
                         case["steps"], list(range(SIZE)))
        assert _max_error(got, want) < TOL
        # θ_g bitwise equal on every rank after every step (it changes only at outer steps)
        for theta, _ in got:
            assert all(_same_everywhere(theta))
        assert d.stats()["outer_steps"] == [case["steps"] // case["sync_every"]] * \
            case["fragments"]
        if case["overlap"]:
            # every all-reduce ran on the runtime's lane (its thread at THREAD_MULTIPLE)
            assert d._lane.completed == case["steps"] // (case["sync_every"] //
                                                          case["fragments"])
            assert (d._lane._thread is not None) == (not progress.inline_only())
        else:
            assert d._lane is None
        topo = get_context(d.comm).topology
        assert d.algorithm == ("hierarchical" if topo.num_nodes > 1 and
                               max(topo.node_sizes) > 1 else "ring")
        if SIZE > 1:
            # the replicas differ between syncs: every step but Algorithm 1's sync steps
            h = case["sync_every"] // case["fragments"]
            for step, (_, mine) in enumerate(got, start=1):
                synced = case["overlap"] == 0 and case["fragments"] == 1 and step % h == 0
                assert all(_same_everywhere(mine)) == synced, step
            # and the all-reduce communicated: averaging this rank's own pseudo-gradient
            # alone gives another θ_g
            alone = reference(case["sync_every"], case["members"], case["overlap"], 0.5,
                              case["steps"], [RANK])
            assert float((got[-1][0] - alone[-1][0]).abs().max()) > 1e-4
    finally:
        d.close()


def test_fragments_given_as_modules(hvd):
    model = _model()
    d = _diloco(model, sync_every=6, fragments=[model[4], model[0], model[2]], overlap=1,
                alpha=0.25)
    try:
        members = [[4, 5], [0, 1], [2, 3]]
        assert d.members == members
        got = _train(d, 1, 14)
        want = reference(6, members, 1, 0.25, 14, list(range(SIZE)))
        assert _max_error(got, want) < TOL
    finally:
        d.close()


@pytest.mark.parametrize("compression", ["int8", "int4", "none"])
def test_compressed_pseudo_gradients(hvd, compression):
    model = _model()
    d = _diloco(model, sync_every=4, fragments=2, overlap=1, compression=compression)
    try:
        got = _train(d, 1, 12)
        for theta, _ in got:
            assert all(_same_everywhere(theta))
        want = reference(4, d.members, 1, 0.5, 12, list(range(SIZE)))
        error = _max_error(got, want)
        if compression == "none":
            assert error < TOL
        else:
            assert 0 < error < 0.05
            state = d.state_dict()
            assert set(state["residuals"]) <= {"fragment0.float64", "fragment1.float64"}
            # error feedback kept what the codec dropped (on the ranks that encode: with
            # the node layout only the ranks that talk to other nodes do)
            mine = any(float(r.abs().max()) > 0 for r in state["residuals"].values())
            assert any(COMM.allgather(mine))
        assert d.stats()["bytes_sent"]["total"] > 0 or SIZE == 1
    finally:
        d.close()


@pytest.mark.parametrize("settings, message", [
    (dict(sync_every=6, fragments=4), "must be a multiple of fragments"),
    (dict(sync_every=8, fragments=4, overlap=2), "must be smaller than sync_every / fragments"),
    (dict(sync_every=4, overlap=4), "must be smaller than sync_every / fragments"),
    (dict(sync_every=0), "sync_every must be an int >= 1"),
    (dict(sync_every=4, overlap=-1), "overlap must be an int >= 0"),
    (dict(sync_every=4, alpha=1.5), "alpha must be in"),
    (dict(sync_every=14, fragments=7), "must not exceed the number of parameter tensors"),
], ids=["H_not_multiple", "tau_ge_period", "tau_ge_H", "H0", "tau_negative", "alpha",
        "F_too_many"])
def test_bad_settings_raise_on_every_rank(hvd, settings, message):
    before = len(comms.alive())
    with pytest.raises(ValueError, match=message):
        _diloco(_model(), **settings)
    assert len(comms.alive()) == before          # its communicator was freed
    COMM.Barrier()


@pytest.mark.parametrize("outer", ["other_model", "inner", "part"])
def test_an_outer_optimizer_not_over_the_model_raises_on_every_rank(hvd, outer):
    """An outer optimizer that does not hold the model's parameters (whose steps would
    leave θ_g where it is while outer_steps counted on), or the inner optimizer itself."""
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=LR)
    params = list(model.parameters())
    opt = {"other_model": lambda: torch.optim.SGD(_model().parameters(), lr=OUTER_LR),
           "inner": lambda: inner,
           "part": lambda: torch.optim.SGD(params[:1], lr=OUTER_LR)}[outer]()
    with pytest.raises(ValueError, match="inner optimizer" if outer == "inner"
                       else "does not hold the model's parameters"):
        hvd.DiLoCo(model, inner, opt, sync_every=4)
    COMM.Barrier()


def test_one_rank_bad_raises_everywhere(hvd):
    if SIZE == 1:
        pytest.skip("needs two ranks")
    overlap = 5 if RANK == SIZE - 1 else 0
    with pytest.raises(ValueError) as info:
        _diloco(_model(), sync_every=4, overlap=overlap)
    if RANK != SIZE - 1:
        assert f"rank {SIZE - 1}: ValueError: overlap (5)" in str(info.value)
    COMM.Barrier()


def test_settings_differ_across_ranks(hvd):
    if SIZE == 1:
        pytest.skip("needs two ranks")
    with pytest.raises(ValueError, match="settings or parameters differ across ranks"):
        _diloco(_model(), sync_every=4 if RANK else 8)
    COMM.Barrier()


def test_type_errors(hvd):
    with pytest.raises(TypeError, match="sync_every must be an int"):
        _diloco(_model(), sync_every="8")
    with pytest.raises(TypeError, match="comm must be an mpi4py intracommunicator"):
        _diloco(_model(), sync_every=4, comm="world")
    COMM.Barrier()


def test_state_dict_round_trip_in_flight(hvd):
    """Saved after a send step (fragment 2's all-reduce in flight), loaded into a fresh
    model, optimizers and DiLoCo: the next steps give the same bits."""
    settings = {"sync_every": 8, "fragments": 4, "overlap": 1, "compression": "int4"}
    model = _model()
    d = _diloco(model, **settings)
    try:
        _train(d, 1, 13)                            # step 13 = 14 - 1 sends fragment 2
        assert d.in_flight() == 2
        saved = (d.state_dict(), {k: v.clone() for k, v in model.state_dict().items()},
                 d.inner_optimizer.state_dict())
        saved = _deep_copy(saved)
        want = _train(d, 14, 22)
    finally:
        d.close()
    model2 = _model_with_seed(99)
    d2 = _diloco(model2, **settings)
    try:
        state, params, inner_state = saved
        model2.load_state_dict(params)
        d2.inner_optimizer.load_state_dict(inner_state)
        d2.load_state_dict(state)
        assert d2.in_flight() == 2 and d2.steps == 13
        got = _train(d2, 14, 22)
        for (a, b), (c, e) in zip(got, want):
            assert torch.equal(a, c) and torch.equal(b, e)
        with pytest.raises(ValueError, match="other settings"):
            d2.load_state_dict({**state, "settings": [[8, 2, 1, 0.5]] + state["settings"][1:]})
    finally:
        d2.close()


def _deep_copy(obj):
    import copy
    return copy.deepcopy(obj)


@pytest.mark.parametrize("overlap", [0, 1])
@pytest.mark.parametrize("steps", [6, 9])
def test_unequal_steps_raise_on_every_rank(hvd, overlap, steps):
    """The last rank takes ``steps`` inner steps, the others 8 (H = 4): with 6 it closes
    while the others wait in the outer all-reduce of step 8; with 9 every sync matched
    and only the step counts differ. Every rank raises MismatchError, none waits."""
    if SIZE == 1:
        pytest.skip("needs two ranks")
    mine = steps if RANK == SIZE - 1 else 8
    before = len(comms.alive())
    with pytest.raises(hvd.MismatchError) as info:
        with _diloco(_model(), sync_every=4, overlap=overlap) as d:
            _train(d, 1, mine)
    text = str(info.value)
    assert "DiLoCo.close" in text
    if RANK == SIZE - 1:
        assert "step() unequally often" in text
    if steps == 9:
        assert f"ranks {SIZE - 1} have 9" in text
    assert len(comms.alive()) == before          # its communicator was freed
    COMM.Barrier()


def test_equal_steps_close_cleanly(hvd):
    with _diloco(_model(), sync_every=4) as d:
        _train(d, 1, 7)
    assert d._closed


def test_frozen_parameter_never_moved(hvd):
    """A frozen parameter (requires_grad=False) gets no outer gradient: an outer optimizer
    with weight decay leaves it as it was (torch's rule), and an outer optimizer over the
    trainable parameters only is accepted."""
    for over_all in (True, False):
        model = _model()
        frozen = model[2].bias
        frozen.requires_grad_(False)
        trainable = [p for p in model.parameters() if p.requires_grad]
        inner = torch.optim.SGD(trainable, lr=LR)
        outer = torch.optim.SGD(model.parameters() if over_all else trainable, lr=OUTER_LR,
                                momentum=OUTER_MOMENTUM, weight_decay=0.1)
        with hvd.DiLoCo(model, inner, outer, sync_every=2) as d:
            start = frozen.detach().clone()          # rank 0's, after construction
            first = model[0].weight.detach().clone()
            _train(d, 1, 4)
            assert d.outer_steps == [2]
            assert torch.equal(frozen, start) and frozen.grad is None
            assert not torch.equal(model[0].weight, first)    # the others did move
