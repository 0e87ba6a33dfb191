"""Serial units of the parameter server's compression (mpicoll.ps.compressed) and a
one-rank co-located run (no mpirun needed)."""
from __future__ import annotations

import numpy as np
import pytest

from mpicoll.compression import Int8Codec, NoneCodec, get_codec
from mpicoll.ps.compressed import (Coders, PullDecoder, PullEncoder, PushEncoder,
                                   check_compressible, resolve_codec)
from mpicoll.ps.placement import ParamSpec
from mpicoll.ps.settings import check_settings

LOSSY = ["fp16", "bf16", "int8", "int8:8:stochastic", "onebit:8", "topk:0.2", "randomk:0.3"]


def _vec(n: int, seed: int, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(dtype)


def test_resolve_codec_and_dtypes():
    assert resolve_codec(None) is None and resolve_codec("none") is None
    assert resolve_codec(NoneCodec()) is None
    c = Int8Codec(chunk=16)
    assert resolve_codec(c) is c and resolve_codec("topk:0.01").name == "topk:0.01"
    with pytest.raises(ValueError, match="unknown compression='lz4'"):
        resolve_codec("lz4")
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        resolve_codec("randomk:1.01")
    with pytest.raises(TypeError, match="codec name or a Codec"):
        resolve_codec(8)
    specs = [ParamSpec("a", (3,), np.dtype(np.float64)), ParamSpec("n", (2,), np.dtype(np.int32))]
    check_compressible(specs[:1], c)
    check_compressible(specs, None)
    with pytest.raises(TypeError, match="parameter 'n' has dtype int32; compression='int8:16'"):
        check_compressible(specs, c)


def test_settings_carry_the_codec():
    base = dict(num_servers=1, consistency="bsp", staleness=0, optimizer="sgd",
                hyperparameters={}, average=None, split_bytes=64, chunk_bytes=64, init=True,
                restore=None, reshard=False, keep_aggregate=True)
    s = check_settings(3, **base, compression="onebit")
    plain = s.as_plain()
    assert s.compression.name == "onebit"
    assert [plain[k] for k in ("compression", "feedback", "replicas")] == ["onebit", True, 0]
    assert check_settings(3, **base).as_plain()["compression"] is None
    assert check_settings(3, **base, compression="int8",
                          feedback=False).as_plain()["feedback"] is False
    with pytest.raises(TypeError, match="feedback=1 must be True or False"):
        check_settings(3, **base, feedback=1)
    with pytest.raises(ValueError, match="topk ratio"):
        check_settings(3, **base, compression="topk:0")


@pytest.mark.parametrize("spec", LOSSY)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_push_encoder_error_feedback_identity(spec, dtype):
    """What the server decodes plus the new residual is the gradient plus the old residual,
    and the payload decodes (from its bytes) to what the encoder reported."""
    codec = get_codec(spec)
    enc = PushEncoder(codec)
    total_in = np.zeros(37, dtype=np.float64)
    total_sent = np.zeros(37, dtype=np.float64)
    for step in range(4):
        x = _vec(37, step, dtype)
        before = enc.feedback.residual(("w", 1))
        before = np.zeros(37, dtype) if before is None else before.copy()
        raw, sent = enc.encode(("w", 1), x)
        assert raw.dtype == np.uint8 and raw.nbytes == enc.wire_bytes(37, dtype)
        np.testing.assert_array_equal(codec.decode_into(raw, 37, np.empty(37, dtype)), sent)
        after = enc.feedback.residual(("w", 1))
        np.testing.assert_allclose(sent + after, x + before, rtol=1e-6, atol=1e-6)
        total_in += x
        total_sent += sent
    np.testing.assert_allclose(total_sent + enc.feedback.residual(("w", 1)), total_in,
                               rtol=1e-5, atol=1e-5)


def test_push_encoder_codec_per_shard():
    """Each shard has its own codec copy: randomk's choice for a shard does not depend on
    how many other shards were encoded before it."""
    x = _vec(50, 1)
    a, b = PushEncoder(get_codec("randomk:0.1")), PushEncoder(get_codec("randomk:0.1"))
    a.encode(("other", 0), _vec(50, 2))
    np.testing.assert_array_equal(a.encode(("w", 0), x)[1], b.encode(("w", 0), x)[1])


@pytest.mark.parametrize("spec", ["int8", "onebit:8", "topk:0.25"])
def test_pull_deltas_keep_replicas_identical(spec):
    """Delta mode: first pull uncompressed, later pulls the compressed change; every
    worker's decoder holds bit for bit the server's replica of it; workers with the same
    history share one encoding; closed workers' replicas are dropped."""
    codec = get_codec(spec)
    n = 45
    enc = PullEncoder(codec, n, np.float32, delta=True)
    decs = {w: PullDecoder(codec, n, np.float32, delta=True) for w in (1, 2, 3)}
    value = _vec(n, 0)

    def pull(w, version):
        data, coded = enc.payload(w, value, version)
        dest = np.empty(n, np.float32)
        assert coded == (decs[w].replica is not None)
        decs[w].apply(data.copy(), coded, dest)
        np.testing.assert_array_equal(dest, enc.value_of(w))
        return data

    first = [pull(w, 0) for w in (1, 2)]
    assert first[0] is first[1]
    np.testing.assert_array_equal(decs[1].replica, value)
    for version in range(1, 6):
        value = value + 0.1 * _vec(n, version)
        a, b = pull(1, version), pull(2, version)
        assert a is b and a.nbytes == codec.wire_bytes(n)     # one encoding per version
        if version == 2:
            pull(3, version)                                   # a late first pull
    assert len(enc.replicas) <= 2
    # the residual (what the replica still misses) stays small: error feedback
    np.testing.assert_allclose(enc.value_of(1), value, atol=0.6)
    for w in (1, 2, 3):
        enc.forget(w)
    assert not enc.replicas and not enc.holders


def test_pull_values_feedback_identity():
    """Value mode (optimizer='sum'): each puller's first pull is the values, exact and
    outside the residual (they are the initial parameters, not an aggregate); then one
    residual per shard, one encoding per version; the delivered values plus the residual
    sum to the values."""
    codec = get_codec("onebit:8")
    enc = PullEncoder(codec, 24, np.float64, delta=False)
    dec = PullDecoder(codec, 24, np.float64, delta=False)
    initial = _vec(24, 99, np.float64)
    for puller in (7, 8):
        data, coded = enc.payload(puller, initial, 0)
        assert not coded and data is not initial
        assert data.tobytes() == initial.tobytes()
        dec.apply(data, False, np.empty(24))
    assert not enc.residual.any() and dec.pulled
    delivered = np.zeros(24)
    total = np.zeros(24)
    for version in range(1, 5):
        value = _vec(24, version, np.float64)
        data, coded = enc.payload(7, value, version)
        assert coded and enc.payload(8, value, version)[0] is data
        out = np.empty(24)
        dec.apply(data, True, out)
        delivered += out
        total += value
    np.testing.assert_allclose(delivered + enc.residual, total, rtol=1e-12, atol=1e-12)


def test_pull_and_checkpoint_state_out_of_order_are_refused():
    """A compressed (delta) pull before the uncompressed first one, and a checkpoint with
    push state for a rank that pushes none, raise ValueError."""
    codec = get_codec("int8")
    dec = PullDecoder(codec, 8, np.float32, delta=True)
    raw = np.zeros(dec.wire_bytes(), dtype=np.uint8)
    with pytest.raises(ValueError, match="before the uncompressed first one"):
        dec.apply(raw, True, np.empty(8, np.float32))
    coders = Coders()
    coders._setup_coders(codec, True, True, pushes=False)
    with pytest.raises(ValueError, match="push state for a rank that pushes none"):
        coders.load_codec_state({"push": ({}, {})})


def test_one_rank_colocated_run():
    """A one-rank world: the owner's own contribution and pull go through the codec too,
    so the values are what a separate server would give."""
    from mpi4py import MPI

    from mpicoll.ps import ParameterServer

    params = {"w": _vec(40, 3), "b": np.zeros(3)}
    ps = ParameterServer(params, comm=MPI.COMM_SELF, num_servers="colocated",
                         optimizer="sgd", lr=0.5, compression="int8:8")
    try:
        first = ps.pull()
        g = {"w": _vec(40, 4), "b": np.ones(3)}
        got = ps.push_pull(g)
        stats = ps.stats()
    finally:
        ps.close()
        ps.free()
    np.testing.assert_array_equal(first["w"], params["w"])
    codec = get_codec("int8:8")
    sent = codec.roundtrip(g["w"])
    want = params["w"] - np.float32(0.5) * sent
    delta = codec.roundtrip(want - params["w"])
    np.testing.assert_array_equal(got["w"], params["w"] + delta)
    assert stats["compression"] == "int8:8"


def test_torch_codec_option():
    pytest.importorskip("torch")
    from mpicoll.torch.ps_optimizer import codec_option
    from mpicoll.torch.compression.compressors import Compression, Compressor

    class Mine(Compressor):
        pass

    assert codec_option(None) is None and codec_option("onebit") == "onebit"
    c = get_codec("int8")
    assert codec_option(c) is c
    assert codec_option(Compression.none) is None
    fp16 = codec_option(Compression.fp16)
    assert fp16 == "fp16" or fp16.name == "fp16"
    for name in ("int8", "onebit", "bf16"):
        if hasattr(Compression, name):
            assert codec_option(getattr(Compression, name)).name == name
    with pytest.raises(ValueError, match="Mine: a compressor without a codec"):
        resolve_codec(codec_option(Mine))
    with pytest.raises(ValueError, match="onebit with momentum: the parameter server"):
        resolve_codec(codec_option(Compression.onebit.with_momentum(0.9)))



def test_auto_compression_is_refused_up_front():
    """compression="auto" picks a codec per all-reduce call; the server's codec is fixed,
    so an Auto fails at construction (not at the first encode), a name as unknown."""
    from mpicoll.compression.auto import Auto  # noqa: PLC0415

    with pytest.raises(TypeError, match="compression='auto'"):
        resolve_codec(Auto())
    with pytest.raises(ValueError):
        resolve_codec("auto")
