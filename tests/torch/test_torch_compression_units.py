"""mpicoll.torch compressors without other ranks: the Compression namespace, codec
attributes, errors, run planning, and DistributedOptimizer with a codec in one process
against a numpy replay (encode, decode, residual)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mpicoll import compression  # noqa: E402
from mpicoll.torch import Compression, Compressor  # noqa: E402
from mpicoll.torch.compression import CodecCompressor, codec_of  # noqa: E402
from mpicoll.torch.fusion import plan_runs  # noqa: E402


def test_compressors_and_their_codecs():
    assert Compression.none.codec is None and codec_of(Compression.none) is None
    assert codec_of(Compression.fp16).name == "fp16"
    for comp, name in ((Compression.bf16, "bf16"), (Compression.int8, "int8"),
                       (Compression.onebit, "onebit"), (Compression.topk(0.01), "topk:0.01"),
                       (Compression.randomk(0.5, seed=3), "randomk:0.5"),
                       (Compression.from_codec("int8:512:stochastic"), "int8:512:stochastic")):
        assert isinstance(comp, CodecCompressor) and comp.name == name
        assert codec_of(comp) is comp.codec and comp.feedback
    assert Compression.randomk(0.5, seed=3).codec.seed == 3
    assert not Compression.topk(0.1, feedback=False).feedback
    assert not Compression.from_codec("none").feedback       # lossless: nothing to keep
    assert "no error feedback" in repr(Compression.from_codec("onebit", feedback=False))

    class Mine(Compressor):
        @staticmethod
        def compress(tensor):
            return tensor * 2, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor / 2

    assert codec_of(Mine) is None


def test_horovod_style_round_trips_still_work():
    t = torch.tensor([1.5, -2.25, 3.0])
    c, ctx = Compression.fp16.compress(t)
    assert c.dtype is torch.float16 and torch.equal(Compression.fp16.decompress(c, ctx), t)
    assert Compression.none.compress(t)[0] is t


def test_wrong_uses_raise_clear_errors():
    for bad in (0, -1, 1.01, float("nan")):
        with pytest.raises(ValueError, match=r"topk ratio must be in \(0, 1\]"):
            Compression.topk(bad)
        with pytest.raises(ValueError, match=r"randomk ratio must be in \(0, 1\]"):
            Compression.randomk(bad)
    with pytest.raises(TypeError, match="ratio must be a number"):
        Compression.topk(None)
    with pytest.raises(ValueError, match="unknown compression='zip'"):
        Compression.from_codec("zip")
    with pytest.raises(TypeError, match="feedback must be True, False or None"):
        CodecCompressor("int8", feedback="yes")
    with pytest.raises(TypeError, match="cannot be summed in compressed form"):
        Compression.int8.compress(torch.ones(2))
    with pytest.raises(TypeError, match="cannot be summed in compressed form"):
        Compression.topk(0.5).decompress(torch.ones(2), None)
    for dtype in (torch.float16, torch.bfloat16, torch.int64, torch.complex64):
        with pytest.raises(TypeError, match=f"'w' has dtype {dtype}; compression='onebit' "
                                            f"needs float32 or float64"):
            Compression.onebit.check_dtype(dtype, "'w'")


def test_plan_runs():
    assert plan_runs([], 10) == []
    assert plan_runs([4, 4, 4], 0) == [range(0, 1), range(1, 2), range(2, 3)]
    assert plan_runs([4, 4, 4], 8) == [range(0, 2), range(2, 3)]
    assert plan_runs([4, 12, 4, 4], 8) == [range(0, 1), range(1, 2), range(2, 4)]
    assert plan_runs([4, 4, 4], 1 << 20) == [range(0, 3)]


def test_single_process_steps_equal_a_numpy_replay():
    import mpicoll.torch as hvd

    hvd.init()
    try:
        if hvd.size() != 1:
            pytest.skip("one process only")
        for spec, comp in (("int8", Compression.int8), ("onebit", Compression.onebit),
                           ("topk:0.25", Compression.topk(0.25))):
            w = torch.nn.Parameter(torch.zeros(5, 3))
            b = torch.nn.Parameter(torch.zeros(3))
            opt = hvd.DistributedOptimizer(torch.optim.SGD([w, b], lr=0.0),
                                           named_parameters=[("w", w), ("b", b)],
                                           compression=comp)
            codec = compression.get_codec(spec)
            residual = np.zeros(18, dtype=np.float32)
            for step in range(3):
                g = torch.Generator().manual_seed(step)
                gw, gb = torch.randn(5, 3, generator=g), torch.randn(3, generator=g)
                opt.zero_grad()
                ((w * gw).sum() + (b * gb).sum()).backward()
                opt.step()
                y = np.concatenate([gb.numpy(), gw.numpy().reshape(-1)]) + residual  # b first
                sent = codec.roundtrip(y)
                residual = y - sent
                got = np.concatenate([b.grad.numpy(), w.grad.numpy().reshape(-1)])
                assert np.array_equal(got, sent), (spec, step)
                fb = opt.error_feedback
                assert np.array_equal(np.concatenate([fb.residual("b"), fb.residual("w")]),
                                      residual), (spec, step)
                assert len(opt.compression_stats) == 1
    finally:
        hvd.shutdown()
