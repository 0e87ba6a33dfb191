"""The compressed all-reduce against a one-process replay of the same arithmetic."""
from __future__ import annotations

import numpy as np
import pytest

from mpicoll.compression import ErrorFeedback, RandomKCodec, allreduce, get_codec, last_stats

from compression_cases import (COUNTS, RANK, SIZE, gather, make_input, reference,
                               shared_reference)

pytestmark = pytest.mark.mpi

DENSE = ["none", "fp16", "bf16", "int8", "int8:4", "onebit", "onebit:8"]
SPARSE = ["topk:0.1", "randomk:0.25", "topk:1"]


def codec_for(spec: str):
    # randomk: a fresh object per test so its step counter starts at 0 on every rank
    return RandomKCodec(float(spec.split(":")[1])) if spec.startswith("randomk") else spec


@pytest.mark.parametrize("dtype,segment", [(np.float32, 64), (np.float32, None),
                                           (np.float64, 256)],
                         ids=["f32-seg64", "f32-segdefault", "f64-seg256"])
@pytest.mark.parametrize("spec", DENSE + SPARSE)
def test_matches_reference_bit_for_bit(spec, dtype, segment):
    if segment == 64 and not get_codec(spec).dense:
        pytest.skip("sparse codecs are not segmented")
    for count in COUNTS:
        fb = ErrorFeedback()
        codec = codec_for(spec)
        ref_res = [None] * SIZE
        for rep in range(2):  # twice: the second call uses the residual of the first
            x = make_input(RANK, count, rep, dtype)
            x_before = x.copy()
            out = allreduce(x, compression=codec, feedback=fb, key="g", segment_bytes=segment)
            assert np.array_equal(x, x_before), "the input was modified"
            inputs = gather(x)
            expect, ref_res = shared_reference(spec, inputs, ref_res, segment,
                                               randomk_step=rep)
            assert out.dtype == dtype and out.shape == (count,)
            assert out.tobytes() == expect.tobytes(), (
                f"{spec} count={count} rep={rep}: max diff {np.abs(out - expect).max()}")
            res = fb.residual("g")
            if count:
                assert res.tobytes() == ref_res[RANK].tobytes(), f"residual {spec} {count}"
            # every rank holds the same bits
            outs = gather(out)
            assert all(o.tobytes() == out.tobytes() for o in outs)
            stats = last_stats()
            if SIZE > 1 and count:
                assert stats.bytes_sent > 0 and stats.messages > 0
            if SIZE > 1 and count > SIZE * 4 and get_codec(spec).dense:
                # it communicated: the result is not this rank's own round trip
                own = get_codec(spec).roundtrip(x)
                assert not np.array_equal(out, own)


@pytest.mark.parametrize("spec", ["fp16", "int8", "onebit", "topk:0.2"])
def test_feedback_conserves_the_total(spec):
    """Sum over ranks of the residuals plus the result = sum of compensated inputs."""
    count = 1009
    fb = ErrorFeedback()
    old = np.zeros(count)
    for rep in range(3):
        x = make_input(RANK, count, rep, np.float32)
        y = x.astype(np.float64) + old
        out = allreduce(x, compression=spec, feedback=fb, segment_bytes=256)
        res = fb.residual()
        total_y = np.sum(gather(y), axis=0)
        total_res = np.sum(gather(res.astype(np.float64)), axis=0)
        scale = np.abs(total_y).max() + 1
        np.testing.assert_allclose(out + total_res, total_y, rtol=0, atol=1e-5 * scale)
        old = res.astype(np.float64)


@pytest.mark.parametrize("spec", ["none", "int8", "topk:0.5"])
def test_average_in_place_and_shapes(spec):
    x = make_input(RANK, 60, 0, np.float64).reshape(6, 10)
    inputs = gather(x.reshape(-1))
    out = allreduce(x, op="average", compression=spec, feedback=False)
    expect, _ = reference(spec, inputs, [None] * SIZE, None)
    assert out.shape == (6, 10)
    assert out.reshape(-1).tobytes() == (expect / SIZE).tobytes()
    buf = x.copy()
    assert allreduce(None, buf, op="average", compression=spec, feedback=False) is buf
    assert buf.tobytes() == out.tobytes()
    if spec == "none":
        np.testing.assert_allclose(out.reshape(-1), np.mean(inputs, axis=0), rtol=1e-12)


def test_lossless_codec_equals_the_exact_sum_on_integers():
    x = (np.arange(1000) % 17 + RANK).astype(np.float32)
    out = allreduce(x, compression="none", segment_bytes=128)
    assert np.array_equal(out, np.sum(gather(x), axis=0))
    if SIZE > 1:
        assert not np.array_equal(out, x)


def test_stats_report_fewer_bytes_for_compressed_codecs():
    x = make_input(RANK, 1 << 14, 0, np.float32)
    sent = {}
    for spec in ["none", "fp16", "int8", "onebit", "topk:0.01"]:
        allreduce(x, compression=spec, feedback=False)
        s = last_stats()
        sent[spec] = s.bytes_sent
        assert s.codec == get_codec(spec).name and s.size == SIZE
    if SIZE > 1:
        assert sent["none"] == last_stats().dense_bytes or sent["none"] > 0
        assert sent["fp16"] * 2 == sent["none"]
        assert sent["int8"] < sent["fp16"] and sent["onebit"] < sent["int8"]
        if SIZE <= 8:
            assert sent["topk:0.01"] < sent["onebit"] * 4


def test_named_randomk_advances_between_calls():
    x = make_input(RANK, 400, 0, np.float32) + 10  # no zeros
    a = allreduce(x, compression="randomk:0.1", feedback=False)
    b = allreduce(x, compression="randomk:0.1", feedback=False)
    # same indices on every rank: the sum has at most k non-zeros
    assert np.count_nonzero(a) <= 40 and np.count_nonzero(b) <= 40
    assert not np.array_equal(np.flatnonzero(a), np.flatnonzero(b))


def test_public_allreduce_takes_compression():
    """``mpicoll.allreduce(x, compression=...)`` is the compressed all-reduce."""
    import mpicoll  # noqa: PLC0415

    x = make_input(RANK, 1009, 0, np.float32)
    ours = mpicoll.allreduce(x, op="average", compression="int8",
                             feedback=ErrorFeedback(), check=True)
    direct = allreduce(x, None, "average", compression="int8", feedback=ErrorFeedback(),
                       key="x")
    assert np.array_equal(ours, direct)
    exact = mpicoll.allreduce(x, compression="none")
    assert np.array_equal(exact, mpicoll.allreduce(x))
    with pytest.raises(ValueError, match="algorithm"):
        mpicoll.allreduce(x, compression="int8", algorithm="ring")
