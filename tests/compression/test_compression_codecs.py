"""Codecs one process at a time: round trips, bounds, wire sizes, bad specs."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpicoll.compression import codecs as C
from mpicoll.compression import get_codec, new_payload

DENSE = ["none", "fp16", "bf16", "int8", "int8:4", "int8:stochastic", "onebit", "onebit:8"]
SPARSE = ["topk:0.01", "topk:0.3", "topk:1", "randomk:0.1", "randomk:1"]
COUNTS = [0, 1, 2, 7, 8, 9, 255, 256, 257, 1000, 4099]


def data(count: int, dtype=np.float32, seed: int = 0) -> np.ndarray:
    return np.random.default_rng([seed, count]).standard_normal(count).astype(dtype)


@pytest.mark.parametrize("spec", DENSE + SPARSE)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_payload_matches_layout_and_wire_bytes(spec, dtype):
    codec = get_codec(spec)
    for count in COUNTS:
        x = data(count, dtype)
        payload = codec.encode(x)
        layout = codec.layout(count, dtype)
        assert isinstance(payload, tuple) and len(payload) == len(layout)
        for part, (dt, n) in zip(payload, layout, strict=True):
            assert part.dtype == dt and part.size == n and part.flags.c_contiguous
        assert sum(p.nbytes for p in payload) == codec.wire_bytes(count, dtype)
        y = codec.decode(payload, count, dtype)
        assert y.dtype == dtype and y.shape == (count,)
        # encoding into a preallocated payload gives the same bytes
        raw, parts = new_payload(codec, count, dtype)
        if spec.startswith("randomk"):
            continue  # each encode draws new indices
        codec2 = get_codec(spec)
        codec2.encode(x, parts)
        if "stochastic" not in spec:
            assert raw.tobytes() == b"".join(p.tobytes() for p in payload)


def test_wire_bytes_formulas():
    n = 1000
    assert get_codec("none").wire_bytes(n) == 4 * n
    assert get_codec("none").wire_bytes(n, np.float64) == 8 * n
    assert get_codec("fp16").wire_bytes(n) == 2 * n
    assert get_codec("bf16").wire_bytes(n) == 2 * n
    assert get_codec("int8").wire_bytes(n) == n + 4 * math.ceil(n / 256)
    assert get_codec("onebit").wire_bytes(n) == math.ceil(n / 8) + 4 * math.ceil(n / 256)
    assert get_codec("topk:0.01").wire_bytes(n) == 10 * (4 + 4)
    assert get_codec("randomk:0.011").wire_bytes(n, np.float64) == 11 * (8 + 4)
    assert get_codec("topk:0.01").wire_bytes(0) == 0
    assert get_codec("topk:0.0001").wire_bytes(5) == 8  # at least one element


def test_fp16_exact_on_small_integers():
    x = np.arange(-2048, 2049, dtype=np.float32)
    assert np.array_equal(get_codec("fp16").roundtrip(x), x)
    x64 = np.arange(-2048, 2049, dtype=np.float64) / 4
    assert np.array_equal(get_codec("fp16").roundtrip(x64), x64)


def test_bf16_exact_on_eight_significant_bits():
    mant = np.arange(-255, 256, dtype=np.float32)
    x = np.concatenate([mant * np.float32(2.0) ** e for e in (-20, -3, 0, 5, 40)])
    assert np.array_equal(get_codec("bf16").roundtrip(x), x)
    assert np.array_equal(get_codec("bf16").roundtrip(x.astype(np.float64)), x)


def _bf16_reference(x: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest bfloat16 (ties to even) via exact float64 arithmetic."""
    b = x.view(np.uint32).astype(np.uint64)
    lo = (b >> 16) << 16
    hi = lo + (1 << 16)
    lo_f = lo.astype(np.uint32).view(np.float32).astype(np.float64)
    hi_f = hi.astype(np.uint32).view(np.float32).astype(np.float64)
    xf = x.astype(np.float64)
    d_lo, d_hi = np.abs(xf - lo_f), np.abs(hi_f - xf)
    even_lo = ((lo >> 16) & 1) == 0
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & ~even_lo)
    return np.where(pick_hi, hi_f, lo_f).astype(np.float32)


def test_bf16_rounds_to_nearest_even():
    one = np.float32(1.0)
    x = np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 1 + 2.0 ** -8 + 2.0 ** -20,
                  -(1 + 2.0 ** -8), 3.0e38, -1e-40, 0.0, -0.0], dtype=np.float32)
    got = get_codec("bf16").roundtrip(x)
    assert got[0] == one                     # tie -> even (down)
    assert got[1] == 1 + 2.0 ** -6           # tie -> even (up)
    assert got[2] == 1 + 2.0 ** -7           # above the tie -> up
    assert got[3] == -one
    assert np.array_equal(got, _bf16_reference(x))
    assert np.signbit(got[-1]) and got[-1] == 0
    rnd = np.random.default_rng(1).standard_normal(100_000).astype(np.float32) * 1e3
    assert np.array_equal(get_codec("bf16").roundtrip(rnd), _bf16_reference(rnd))


def test_bf16_keeps_nan_and_infinity():
    nan_low = np.array([0x7F800001, 0xFF800001], dtype=np.uint32).view(np.float32)
    x = np.concatenate([nan_low, np.array([np.inf, -np.inf, np.nan], np.float32)])
    got = get_codec("bf16").roundtrip(x)
    assert np.isnan(got[[0, 1, 4]]).all()
    assert got[2] == np.inf and got[3] == -np.inf


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("chunk", [1, 4, 256, 1000])
def test_int8_error_at_most_half_a_scale_per_chunk(dtype, chunk):
    codec = C.Int8Codec(chunk=chunk)
    for count in COUNTS:
        x = data(count, dtype) * 10
        scales, q = codec.encode(x)
        y = codec.decode((scales, q), count, dtype)
        per_elem_scale = np.repeat(scales, chunk)[:count].astype(np.float64)
        err = np.abs(y.astype(np.float64) - x)
        assert (err <= per_elem_scale * (0.5 + 1e-5) + 1e-30).all()
        assert (np.abs(q.astype(int)) <= 127).all()
        # scale is max|x| / 127 per chunk
        for k in range(min(len(scales), 5)):
            blk = x[k * chunk:(k + 1) * chunk]
            assert scales[k] == np.float32(np.abs(blk).max() / 127)


def test_int8_zero_chunk_and_extremes_exact():
    x = np.zeros(600, np.float32)
    x[300:556] = np.linspace(-127, 127, 256)
    y = get_codec("int8").roundtrip(x)
    assert np.array_equal(y[:256], np.zeros(256)) and np.array_equal(y[556:], np.zeros(44))
    assert y[300] == -127 and y[555] == 127


def test_int8_stochastic_bound_unbiased_and_seeded():
    x = np.full(100_000, 0.3, np.float32)
    x[0] = 1.0  # the scale of chunk 0 is 1/127; elsewhere 0.3/127 so x/s = 127 exactly
    x[256:] = np.random.default_rng(3).uniform(-1, 1, x.size - 256)
    codec = C.Int8Codec(stochastic=True, seed=7)
    scales, q = codec.encode(x)
    y = codec.decode((scales, q), x.size)
    s = np.repeat(scales, 256)[:x.size]
    assert (np.abs(y - x) <= s * (1 + 1e-5)).all()
    # unbiased: element 1 (0.3 with scale 1/127 -> 38.1) averaged over many draws
    draws = [C.Int8Codec(stochastic=True, seed=k).roundtrip(x[:256])[1] for k in range(400)]
    assert abs(np.mean(draws) - 0.3) < 3 * (1 / 127) / np.sqrt(400) * 2
    again = C.Int8Codec(stochastic=True, seed=7).encode(x)
    assert np.array_equal(again[1], q)


@pytest.mark.parametrize("chunk", [8, 256, 1024])
def test_onebit_is_sign_times_chunk_mean(chunk):
    codec = C.OneBitCodec(chunk=chunk)
    for count in COUNTS:
        x = data(count)
        x[::7] = 0.0
        y = codec.roundtrip(x)
        for k in range(0, count, chunk):
            blk = x[k:k + chunk]
            mean = np.float32(np.abs(blk).astype(np.float64).mean())
            expect = np.where(np.signbit(blk), -mean, mean)
            np.testing.assert_allclose(y[k:k + chunk], expect, rtol=1e-5)
        assert np.array_equal(np.signbit(y) & (y != 0), np.signbit(x) & (y != 0))


def test_topk_keeps_the_largest():
    x = data(1000)
    codec = get_codec("topk:0.05")
    y = codec.roundtrip(x)
    kept = np.flatnonzero(y)
    assert kept.size == 50
    assert np.array_equal(y[kept], x[kept])
    assert np.abs(x[kept]).min() >= np.sort(np.abs(x))[-50]
    _values, idx = codec.encode(x)
    assert (np.diff(idx) > 0).all() and idx.dtype == np.int32


def test_randomk_shared_seed_agrees_per_step():
    x = data(500)
    a, b = C.RandomKCodec(0.1, seed=5), C.RandomKCodec(0.1, seed=5)
    idx_a = [a.indices_values(a.encode(x))[0].copy() for _ in range(3)]
    idx_b = [b.indices_values(b.encode(x * 2))[0].copy() for _ in range(3)]
    for ia, ib in zip(idx_a, idx_b, strict=True):
        assert np.array_equal(ia, ib) and ia.size == 50 and (np.diff(ia) > 0).all()
    assert not np.array_equal(idx_a[0], idx_a[1])
    other = C.RandomKCodec(0.1, seed=6)
    assert not np.array_equal(other.indices_values(other.encode(x))[0], idx_a[0])
    y = C.RandomKCodec(0.1, seed=5).roundtrip(x)
    assert np.array_equal(y[idx_a[0]], x[idx_a[0]]) and np.count_nonzero(y) <= 50


@pytest.mark.parametrize("spec", ["none", "fp16", "bf16", "int8", "onebit", "topk:1",
                                  "randomk:1"])
def test_lossless_where_expected(spec):
    x = np.arange(-50, 50, dtype=np.float32)
    y = get_codec(spec).roundtrip(x)
    if spec in ("none", "fp16", "bf16", "topk:1", "randomk:1"):
        assert np.array_equal(y, x)
    assert get_codec(spec).lossy == (spec != "none")
    assert get_codec(spec).dense == (not spec.startswith(("topk", "randomk")))


@pytest.mark.parametrize("spec,exc,words", [
    ("gzip", ValueError, "unknown compression='gzip'"),
    ("topk", ValueError, "needs a ratio"),
    ("topk:0", ValueError, "ratio must be in (0, 1]"),
    ("topk:1.5", ValueError, "ratio must be in (0, 1]"),
    ("randomk:-0.1", ValueError, "ratio must be in (0, 1]"),
    ("topk:abc", ValueError, "is not a number"),
    ("fp16:3", ValueError, "takes no parameter"),
    ("int8:fast", ValueError, "unknown option"),
    ("onebit:12", ValueError, "multiple of 8"),
    ("int8:0", ValueError, "chunk must be a positive"),
    (3, TypeError, "compression must be a codec name"),
])
def test_bad_specs(spec, exc, words):
    with pytest.raises(exc) as info:
        get_codec(spec)
    assert words in str(info.value)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match=r"topk ratio must be in \(0, 1\]"):
        C.TopKCodec(2.0)
    with pytest.raises(TypeError, match="ratio must be a number"):
        C.RandomKCodec("0.1")
    with pytest.raises(TypeError, match="chunk must be an int"):
        C.Int8Codec(chunk=2.5)


@pytest.mark.parametrize("spec", ["fp16", "bf16", "int8", "onebit", "topk:0.1", "none"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.float16, np.complex64, np.bool_])
def test_non_float_data_is_rejected(spec, dtype):
    with pytest.raises(TypeError) as info:
        get_codec(spec).encode(np.zeros(4, dtype))
    assert f"x has dtype {np.dtype(dtype)}" in str(info.value)
    assert "float32 or float64" in str(info.value)


def test_get_codec_passes_objects_through():
    c = C.Int8Codec(chunk=64)
    assert get_codec(c) is c
    assert get_codec(None).name == "none"
    assert get_codec("INT8:64").chunk == 64
    assert get_codec("topk:0.25").name == "topk:0.25"


@settings(max_examples=60, deadline=None)
@given(count=st.integers(0, 700), chunk=st.sampled_from([1, 3, 8, 64, 256]),
       scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e4]), seed=st.integers(0, 10))
def test_int8_bound_property(count, chunk, scale, seed):
    x = data(count, seed=seed) * np.float32(scale)
    codec = C.Int8Codec(chunk=chunk)
    scales, q = codec.encode(x)
    y = codec.decode((scales, q), count)
    s = np.repeat(scales.astype(np.float64), chunk)[:count]
    assert (np.abs(y.astype(np.float64) - x) <= s * (0.5 + 1e-5)).all()


@pytest.mark.parametrize("spec", ["bf16", "int8", "int8:100", "onebit", "onebit:24"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_blocked_kernels_match_one_big_block(spec, dtype, monkeypatch):
    """Vectors longer than BLOCK_ELEMENTS (several blocks, a partial last chunk) encode to
    the same bytes as with one block covering everything, and decode the same."""
    count = 3 * C.BLOCK_ELEMENTS + 77
    x = data(count, dtype, seed=4)
    blocked = get_codec(spec)
    payload = blocked.encode(x)
    y = blocked.decode(payload, count, dtype)
    monkeypatch.setattr(C, "BLOCK_ELEMENTS", 1 << 30)
    whole = get_codec(spec)
    payload1 = whole.encode(x)
    assert all(np.array_equal(a, b) for a, b in zip(payload, payload1, strict=True))
    assert np.array_equal(y, whole.decode(payload1, count, dtype))
    if spec.startswith("int8"):
        s = np.repeat(payload[0].astype(np.float64), blocked.chunk)[:count]
        assert (np.abs(y.astype(np.float64) - x) <= s * (0.5 + 1e-5)).all()


@pytest.mark.parametrize("spec", ["randomk:0.3", "int8:stochastic", "int8", "onebit", "topk:0.2"])
def test_codec_state_restores_the_next_encodings(spec):
    """A codec made afresh and given another's state_dict encodes the next vectors as that
    one does (randomk's step, stochastic int8's generator); stateless codecs have none."""
    x = np.random.default_rng(5).standard_normal(300).astype(np.float32)
    used = get_codec(spec)
    for _ in range(3):
        used.encode(x)
    state = used.state_dict()
    if spec in ("int8", "onebit", "topk:0.2"):
        assert state == {}
    fresh = get_codec(spec)
    fresh.load_state_dict(state)
    for _ in range(2):
        a, b = used.encode(x), fresh.encode(x)
        assert all(np.array_equal(p, q) for p, q in zip(a, b))
    if spec.startswith(("randomk", "int8:")):
        assert not all(np.array_equal(p, q)
                       for p, q in zip(get_codec(spec).encode(x), used.encode(x)))


def test_codec_state_of_another_codec_is_refused():
    with pytest.raises(ValueError, match="does not belong to compression='int8'"):
        get_codec("int8").load_state_dict({"step": 3})
    with pytest.raises(ValueError, match="does not belong to compression='randomk:0.5'"):
        get_codec("randomk:0.5").load_state_dict({})
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        get_codec("randomk:0.5").load_state_dict({"step": -1})
    with pytest.raises(ValueError, match="does not belong to compression='int8:stochastic'"):
        get_codec("int8:stochastic").load_state_dict({"step": 1})


def test_topk_ties_go_to_the_lower_indices():
    """The k largest magnitudes, ties at the k-th broken towards the lower index (the
    rule numpy and CuPy both compute), NaN as infinite; against a stable sort."""
    rng = np.random.default_rng(8)
    for count, k_ratio in [(1000, 0.05), (257, 0.3), (64, 0.5)]:
        x = rng.integers(-4, 5, count).astype(np.float32)    # many equal magnitudes
        x[3] = np.nan
        codec = get_codec(f"topk:{k_ratio}")
        k = codec.k(count)
        idx, _values = codec.indices_values(codec.encode(x))
        mag = np.where(np.isnan(x), np.inf, np.abs(x))
        want = np.sort(np.lexsort((np.arange(count), -mag))[:k])
        assert np.array_equal(idx, want)


def test_counter_uniforms_exact_in_range_and_block_independent():
    from mpicoll.compression.counter_rng import stream_key, uniform
    key = stream_key(7, 3)
    for dtype, bits in ((np.float32, 24), (np.float64, 53)):
        u = uniform(np, key, 0, 10_000, dtype)
        assert u.dtype == dtype and (u >= 0).all() and (u < 1).all()
        assert np.array_equal(u * 2.0 ** bits, np.floor(u * 2.0 ** bits))   # on the grid
        assert abs(u.mean() - 0.5) < 0.02 and len(np.unique(u)) > 9_900
        assert np.array_equal(uniform(np, key, 1234, 500, dtype), u[1234:1734])
    assert not np.array_equal(uniform(np, stream_key(7, 4), 0, 100, np.float32),
                              uniform(np, key, 0, 100, np.float32))
    assert stream_key(7, 3) != stream_key(8, 3)


def test_pairwise_row_sums_order():
    """Right half added onto the left half (odd last column onto the first), repeatedly:
    the order both array modules follow, checked against a scalar replay."""
    rng = np.random.default_rng(2)
    for width in (0, 1, 2, 3, 7, 8, 24, 32, 40, 64, 65, 256):
        rows = (rng.standard_normal((5, width)) * 10.0 ** rng.integers(-6, 6, (5, width))
                ).astype(np.float32)

        def replay(r):
            r = list(r) or [np.float32(0.0)]
            while len(r) > 1:
                h, odd = len(r) // 2, len(r) % 2
                last = r[-1]
                r = [np.float32(a + b) for a, b in zip(r[:h], r[h:2 * h])]
                if odd:
                    r[0] = np.float32(r[0] + last)
            return r[0]

        want = np.array([replay(r) for r in rows], dtype=np.float32)
        got = C.pairwise_row_sums(np, rows.copy())
        assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("spec", ["int8", "int8:24", "int8:stochastic"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_int8_zero_and_denormal_chunks_have_scale_plus_zero(spec, dtype):
    """A chunk of zeros (either sign) or of denormals is sent as zeros with the scale +0.0
    exactly, without overflowing 1/scale: found on an H200, where CuPy wrote +0.0 and numpy
    -0.0 for max(0.0, -0.0), so the wire bits depended on the array module."""
    import warnings  # noqa: PLC0415

    codec = get_codec(spec)
    x = np.zeros(300, dtype=dtype)          # the first chunk (24 or 256) zeros/denormals
    x[1], x[2] = -0.0, 1e-44
    x[256:] = np.linspace(-1, 1, 44)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scales, q = codec.encode(x)
    assert np.asarray(scales)[0].tobytes() == np.float32(0.0).tobytes()
    assert not np.asarray(q)[:24].any()


@pytest.mark.parametrize("spec", ["int8:4", "int8:4:stochastic", "int4:4"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_integer_codecs_keep_a_non_finite_chunk_visible(spec, bad, dtype):
    """A chunk holding NaN or an infinity decodes to NaN, without a warning; the other
    chunks as usual. Before: a NaN made its chunk zeros (a diverging rank's gradient
    vanished silently, and with error feedback stayed wrong every step after), int4 turned
    +inf into -inf, int8 warned of an invalid cast."""
    import warnings

    codec = get_codec(spec)
    x = np.array([1, -2, 3, 0.5, 4, 1, -1, 2, 0.25, 1, 1, 1], dtype=dtype)
    x[5] = bad
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = codec.roundtrip(x)
    assert np.isnan(out[4:8]).all()
    assert np.isfinite(out[:4]).all() and np.isfinite(out[8:]).all()
    np.testing.assert_allclose(out[:4], x[:4], atol=0.3 * 2 if "int4" in spec else 0.05)
