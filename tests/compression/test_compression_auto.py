"""compression="auto" in one process: the time model's choice from synthetic inputs, the
spec and its errors, the one-rank all-reduce, the torch compressor (the MPI suite,
tests/compression/mpi/test_compression_auto.py, checks agreement across ranks)."""
from __future__ import annotations

import numpy as np
import pytest

from mpicoll import compression
from mpicoll.compression import Auto, auto, cost_model, probe
from mpicoll.compression.cost_model import Layout, ModelInputs, Speed, choose, predict

GB = 1e9
MB = 1e6


def inputs(latency=5e-6, bandwidth=10 * GB, enc=None, dec=None, add=Speed(1e-6, 10 * GB)):
    """Synthetic model inputs: dense codecs 5 GB/s both ways, top-k 0.1 GB/s to encode
    (a partition), unless given."""
    speeds = {"none": Speed(1e-6, 20 * GB), "bf16": Speed(2e-6, 5 * GB),
              "int8": Speed(3e-6, 5 * GB), "topk:0.01": Speed(5e-6, 5 * GB)}
    return ModelInputs(latency, bandwidth,
                       {**speeds, "topk:0.01": Speed(5e-6, 0.1 * GB), **(enc or {})},
                       {**speeds, **(dec or {})}, add, "given")


CANDS = cost_model.DEFAULT_CANDIDATES
MiB = 1 << 20


@pytest.mark.parametrize("case,count,n,expected", [
    # a fast link: nothing pays
    (inputs(bandwidth=50 * GB), 4 * MiB, 4, "none"),
    # a slow link and fast codecs: int8's 3.9x fewer bytes win at 16 MiB
    (inputs(bandwidth=100 * MB), 4 * MiB, 4, "int8"),
    # ... but not for a tiny vector, where the per-call overheads dominate (among the
    # dense codecs; top-k's all-gather sends fewer messages than a ring: see below)
    (inputs(bandwidth=100 * MB), 64, 4, "none"),
    # int8 slow to encode, bf16 fast: bf16
    (inputs(bandwidth=300 * MB, enc={"int8": Speed(3e-6, 0.3 * GB)}), 4 * MiB, 4, "bf16"),
    # a very slow link: top-k 1% (50x fewer bytes) beats int8
    (inputs(bandwidth=5 * MB), 4 * MiB, 2, "topk:0.01"),
    # high latency, few messages: the sparse all-gather sends n-1 messages, the ring 2(n-1)m
    (inputs(latency=0.05, bandwidth=50 * GB), 1 << 16, 8, "topk:0.01"),
])
def test_choice_from_synthetic_inputs(case, count, n, expected):
    cands = CANDS if count > 64 else CANDS[:3]
    choice = choose(case, cands, count, np.float32, Layout(n))
    assert choice.codec == expected, choice.predicted
    assert set(choice.predicted) == set(cands)
    assert min(choice.predicted, key=choice.predicted.get) == expected
    assert expected in choice.reason


def test_prediction_follows_the_formula():
    """The dense ring's prediction, written out: 2(n-1) messages per segment, n encodes,
    ((n-1)(1+f) + n) decodes and (n-1) + f n additions per segment."""
    inp = inputs(latency=1e-5, bandwidth=1 * GB)
    n, count, seg = 3, 3 * 1000, 1 << 30
    q = count * 4 / n
    wire = compression.get_codec("int8").wire_bytes(count // n, np.float32)
    e, d, a = inp.encode["int8"].seconds(q), inp.decode["int8"].seconds(q), inp.add.seconds(q)
    expected = 4 * (1e-5 + wire / GB) + 3 * e + (2 * 2 + 3) * d + (2 + 3) * a
    assert predict(inp, "int8", count, np.float32, Layout(n), seg) == pytest.approx(expected)
    # without feedback: fewer decodes and additions; none never has feedback
    expected_nofb = 4 * (1e-5 + wire / GB) + 3 * e + (2 + 3) * d + 2 * a
    assert predict(inp, "int8", count, np.float32, Layout(n), seg, feedback=False) == \
        pytest.approx(expected_nofb)
    assert predict(inp, "int8", 0, np.float32, Layout(n)) == 0.0


def test_node_layout_and_other_collectives_predict():
    inp = inputs(bandwidth=100 * MB)
    flat = predict(inp, "int8", 1 << 22, np.float32, Layout(8))
    node = predict(inp, "int8", 1 << 22, np.float32, Layout(8, 2, 4))
    assert node > 0 and flat > 0
    for coll in ("reduce_scatter", "allgather"):
        for c in CANDS:
            assert predict(inp, c, 1 << 20, np.float32, Layout(4), collective=coll) > 0


def test_margin_keeps_none_unless_clearly_faster():
    case = inputs(bandwidth=100 * MB)
    plain = choose(case, CANDS, 4 * MiB, np.float32, Layout(4))
    gain = 1 - plain.predicted[plain.codec] / plain.predicted["none"]
    assert plain.codec != "none" and 0 < gain < 0.99
    assert choose(case, CANDS, 4 * MiB, np.float32, Layout(4), margin=min(0.99, gain + 0.005)
                  ).codec == "none"
    assert choose(case, CANDS, 4 * MiB, np.float32, Layout(4), margin=gain / 2).codec != "none"


def test_ties_go_to_the_first_candidate():
    same = Speed(1e-6, 5 * GB)
    case = ModelInputs(0.0, float("inf"), {"none": same, "fp16": same},
                       {"none": same, "fp16": same}, same)
    assert choose(case, ("none", "fp16"), 1000, np.float32, Layout(1)).codec == "none"


def test_spec_and_options():
    a = auto.codec_from_spec("auto")
    assert isinstance(a, Auto) and a.candidates == CANDS and a.name == "auto"
    b = auto.codec_from_spec("auto:none,int8,topk:0.05")
    assert b.candidates == ("none", "int8", "topk:0.05") and b.name == "auto:none,int8,topk:0.05"
    c = Auto(("none", "int8"), latency=1e-4, bandwidth=1.25e8, margin=0.1)
    assert c.name == "auto:none,int8[latency=0.0001,bandwidth=1.25e+08][margin=0.1]"
    assert auto.is_auto("auto:none,int8") and auto.is_auto(c) and not auto.is_auto("int8")


@pytest.mark.parametrize("make,exc,words", [
    (lambda: Auto(()), ValueError, "at least one candidate"),
    (lambda: Auto(("none", "auto")), ValueError, "cannot be its own candidate"),
    (lambda: Auto(("none", "lz4")), ValueError, "unknown compression='lz4'"),
    (lambda: Auto(("int8", "int8")), ValueError, "repeated candidates"),
    (lambda: Auto("int8"), TypeError, "sequence of codec names"),
    (lambda: Auto((8,)), TypeError, "codec names, not int"),
    (lambda: Auto(latency=1e-5), ValueError, "both latency and bandwidth"),
    (lambda: Auto(latency=-1.0, bandwidth=1e9), ValueError, "latency must be >= 0"),
    (lambda: Auto(latency=1e-5, bandwidth=0), ValueError, "bandwidth > 0"),
    (lambda: Auto(latency="1", bandwidth=1e9), TypeError, "latency must be a number"),
    (lambda: Auto(margin=1.5), ValueError, "margin must be in [0, 1)"),
    (lambda: auto.codec_from_spec("auto:none,topk:2"), ValueError, "ratio must be in (0, 1]"),
    (lambda: auto.codec_from_spec("auto:"), ValueError, "unknown compression=''"),
    (lambda: compression.allreduce(np.ones(4, np.float32), compression="auto:zstd"),
     ValueError, "unknown compression='zstd'"),
    (lambda: compression.allreduce(np.arange(4), compression="auto"), TypeError,
     "compression='auto' needs float32 or float64"),
    (lambda: Auto().encode(np.ones(3, np.float32)), TypeError, "is resolved to a codec"),
    (lambda: choose(inputs(), (), 10, np.float32, Layout(2)), ValueError, "at least one"),
    (lambda: choose(inputs(), ("none",), 10, np.float32, Layout(2), margin=1.0), ValueError,
     "margin must be in [0, 1), got 1.0"),
    (lambda: predict(ModelInputs(5e-6, 10 * GB, {}, {}, Speed(1e-6, GB), "given"), "int8", 10,
                     np.float32, Layout(2)), ValueError, "no encode speed for codec 'int8'"),
    (lambda: Auto().layout(10), TypeError, "is resolved to a codec"),
    (lambda: Auto(("none", "int8")).decode((), 10), TypeError,
     "here pass a codec (none, int8)"),
    (lambda: Auto().load_state_dict({"lz4": {}}), ValueError, "does not belong to"),
    (lambda: Auto().load_state_dict([]), ValueError, "does not belong to"),
])
def test_bad_inputs(make, exc, words):
    with pytest.raises(exc) as info:
        make()
    assert words in str(info.value)


@pytest.fixture
def synthetic(monkeypatch):
    """Codec speeds that make int8 the choice (no timing): a given slow link."""
    fast = Speed(1e-7, 50 * GB)

    def speeds(names, like=None):
        table = {n: fast for n in ["none", *names]}
        return table, dict(table), fast
    monkeypatch.setattr(probe, "codec_speeds", speeds)
    return Auto(latency=1e-5, bandwidth=1e8)


def test_one_rank_auto_equals_the_chosen_codec(synthetic):
    """At n = 1 the link does not matter; with synthetic speeds the choice is fixed by
    compute alone (none: the fewest operations); results and residuals equal the codec's."""
    x = np.random.default_rng(1).standard_normal(1001).astype(np.float32)
    fb1, fb2 = compression.ErrorFeedback(), compression.ErrorFeedback()
    for spec in (synthetic, Auto(("int8",)), Auto(("topk:0.1", "bf16"))):
        out = compression.allreduce(x, compression=spec, feedback=fb1, key=spec.name)
        stats = compression.last_stats()
        assert stats.choice is not None and stats.codec == stats.choice.codec
        assert stats.codec in spec.candidates
        ref = compression.allreduce(x, compression=stats.codec, feedback=fb2, key=spec.name)
        assert np.array_equal(out, ref)
        assert np.array_equal(fb1.residual(spec.name), fb2.residual(spec.name))
    assert compression.allreduce(x, compression="int8") is not None
    assert compression.last_stats().choice is None


def test_stats_carry_the_inputs(synthetic):
    compression.allreduce(np.ones(64, np.float32), compression=synthetic)
    choice = compression.last_stats().choice
    assert choice.inputs["link_source"] == "given"
    assert set(choice.inputs["encode"]) >= set(synthetic.candidates)
    assert set(choice.predicted) == set(synthetic.candidates)


def test_measured_speeds_are_positive_and_cached():
    """The real measurement (no timing asserted): positive rates, cached per process."""
    enc, dec, add = probe.codec_speeds(["int8"])
    assert enc["int8"].rate > 0 and dec["int8"].rate > 0 and add.rate > 0
    assert enc["none"].overhead >= 0
    assert probe.codec_speeds(["int8"])[0]["int8"] is enc["int8"]


def test_torch_compressor():
    torch = pytest.importorskip("torch")  # noqa: F841
    from mpicoll.torch.compression import Compression

    assert isinstance(Compression.auto.codec, Auto) and Compression.auto.name == "auto"
    assert Compression.auto.feedback
    comp = Compression.from_codec("auto:none,int8")
    assert comp.codec.candidates == ("none", "int8")
    state = Compression.from_codec(Auto(("none", "randomk:0.1"))).codec.state_dict()
    assert state == {"randomk:0.1": {"step": 0}}


def test_distributed_optimizer_with_auto_equals_the_chosen_codec(monkeypatch):
    """DistributedOptimizer(compression=Compression.auto), one process: synthetic speeds
    make int8 the cheapest computation; three steps give the same gradients and residuals
    as Compression.int8, and the stats name int8 with the choice."""
    torch = pytest.importorskip("torch")
    import mpicoll.torch as hvd
    from mpicoll.torch.compression import Compression

    slow, fast = Speed(1e-3, 0.1 * GB), Speed(1e-7, 50 * GB)

    def speeds(names, like=None):
        table = {n: (fast if n == "int8" else slow) for n in ["none", *names]}
        return table, dict(table), fast
    monkeypatch.setattr(probe, "codec_speeds", speeds)
    hvd.init()
    try:
        if hvd.size() != 1:
            pytest.skip("one process only")
        results = {}
        for name, comp in (("auto", Compression.auto), ("int8", Compression.int8)):
            torch.manual_seed(0)
            model = torch.nn.Linear(7, 3)
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(),
                                           compression=comp)
            grads = []
            for step in range(3):
                opt.zero_grad()
                model(torch.arange(14.0).reshape(2, 7) / (step + 1)).pow(2).sum().backward()
                opt.step()
                grads.append([p.grad.clone() for p in model.parameters()])
            stats = opt.compression_stats
            results[name] = (grads, [opt.error_feedback.residual(k).copy()
                                     for k in sorted(opt.error_feedback.keys())], stats)
        (ga, ra, sa), (gi, ri, si) = results["auto"], results["int8"]
        assert all(torch.equal(a, b) for sa_, sb_ in zip(ga, gi) for a, b in zip(sa_, sb_))
        assert all(np.array_equal(a, b) for a, b in zip(ra, ri))
        assert [s.codec for s in sa] == ["int8"] and sa[0].choice.codec == "int8"
        assert si[0].choice is None
    finally:
        hvd.shutdown()


def test_state_dict_round_trip_and_a_bad_state_changes_nothing():
    """``Auto.load_state_dict`` restores each candidate's state (random-k's step), after
    checking all of them on fresh codecs: a bad one leaves every candidate as it was."""
    names = ("none", "randomk:0.5", "randomk:0.25")
    a = Auto(names)
    x = np.linspace(-1.0, 1.0, 16, dtype=np.float32)
    a.codec("randomk:0.5").encode(x)
    saved = a.state_dict()
    assert saved == {"randomk:0.5": {"step": 1}, "randomk:0.25": {"step": 0}}
    b = Auto(names)
    b.load_state_dict(saved)
    assert b.state_dict() == saved
    assert all(np.array_equal(p, q) for p, q in zip(a.codec("randomk:0.5").encode(x),
                                                     b.codec("randomk:0.5").encode(x)))
    with pytest.raises(ValueError):
        b.load_state_dict({"randomk:0.5": {"step": 7}, "randomk:0.25": {"step": -1}})
    assert b.state_dict() == {"randomk:0.5": {"step": 2}, "randomk:0.25": {"step": 0}}


@pytest.mark.parametrize("link", [
    {"bandwidth_bytes_per_s": 1e9},                               # no latency
    {"latency_s": 1e-5},                                          # no bandwidth
    {"latency_s": "fast", "bandwidth_bytes_per_s": 1e9},          # not a number
    {"latency_s": 1e-5, "bandwidth_bytes_per_s": None},
    {"latency_s": -1e-6, "bandwidth_bytes_per_s": 1e9},           # negative latency
    {"latency_s": 1e-5, "bandwidth_bytes_per_s": 0},              # no bandwidth at all
    {"latency_s": 1e-5, "bandwidth_bytes_per_s": -1e9},
    {"latency_s": 1e-5, "bandwidth_bytes_per_s": float("nan")},
    [1e-5, 1e9],                                                  # not an object
])
def test_a_table_link_that_is_not_usable_is_ignored(link):
    """A tuning table's ``meta.link`` lacking a key, holding a non-number, a negative
    latency or a bandwidth that is not positive gives no link (the link is then measured);
    a valid one from the same table gives its figures and names the table."""
    from mpicoll import tuning

    table = {"format": tuning.FORMAT, "meta": {"link": link}, "collectives": {}}
    try:
        tuning.use_table(table)
        assert auto._table_link() is None
        tuning.use_table({**table, "meta": {"link": {"latency_s": 2e-5,
                                                     "bandwidth_bytes_per_s": 3e8}}})
        latency, bandwidth, source = auto._table_link()
        assert (latency, bandwidth) == (2e-5, 3e8) and source.startswith("tuning table")
    finally:
        tuning.use_table(None)


class _FakeContext:
    """What :func:`auto.model_layout` reads of a context: its size and node sizes."""

    def __init__(self, node_sizes):
        self.size = sum(node_sizes)
        self.topology = type("Topology", (), {"node_sizes": tuple(node_sizes)})()


@pytest.mark.parametrize("nodes,shape,expected", [
    ((2, 2, 2), "flat", Layout(6)),
    ((2, 2, 2), "node", Layout(6, 3, 2)),
    ((4,), "node", Layout(4, 1, 4)),
    # uneven nodes: the model's time is that of the leaders' ring on the whole vector
    ((2, 2, 1), "node", Layout(3)),
    ((3, 1), "node", Layout(2)),
    ((3, 1), "flat", Layout(4)),
])
def test_model_layout(nodes, shape, expected):
    assert auto.model_layout(_FakeContext(nodes), shape) == expected


def test_resolve_bounds_its_cache_of_choices(synthetic):
    """The choices of a communicator are cached per call shape; past 1024 of them the
    cache starts again (holding the new choice only), and up to 1024 it keeps them all."""
    from mpi4py import MPI

    from mpicoll.context import get_context

    comm = MPI.COMM_SELF.Dup()
    try:
        ctx = get_context(comm)
        x = np.ones(100, np.float32)
        state = auto._state(ctx, synthetic, x[:0])
        codec, choice = auto.resolve(ctx, synthetic, x, "flat", 0, None)
        assert codec is synthetic.codec(choice.codec) and len(state.choices) == 1
        (key, cached), = state.choices.items()
        assert cached is choice
        assert auto.resolve(ctx, synthetic, x, "flat", 0, None)[1] is choice   # cached
        state.choices.update({("other", i): choice for i in range(1023)})       # 1024 now
        y = np.ones(101, np.float32)
        first = auto.resolve(ctx, synthetic, y, "flat", 0, None)[1]
        assert len(state.choices) == 1025 and state.choices[key] is choice  # all kept
        z = np.ones(102, np.float32)
        codec, new = auto.resolve(ctx, synthetic, z, "flat", 0, None)
        assert list(state.choices.values()) == [new] and key not in state.choices
        assert codec is synthetic.codec(new.codec)
        assert auto.resolve(ctx, synthetic, y, "flat", 0, None)[1] is not first  # chosen anew
        assert len(state.choices) == 2
    finally:
        comm.Free()
