"""GPU: every codec on CuPy arrays equals the numpy codec bit for bit (payload and decoded
values), stateful codecs included; only payloads cross between host and device.
Skipped, with the reason, without a GPU (the CPU stand-in is test_gpu_codecs_fake.py).
"""
from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import gpu_skip_reason
from mpicoll.compression import ErrorFeedback, get_codec, new_payload
from mpicoll.compression import codecs as C

_REASON = gpu_skip_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"GPU tests: {_REASON}")

SPECS = ["none", "fp16", "bf16", "int8", "int8:24", "int8:stochastic", "onebit", "onebit:24",
         "onebit:two", "onebit:24:two",
         "topk:0.05", "topk:1", "randomk:0.1", "randomk:1"]
COUNTS = [0, 1, 7, 8, 9, 255, 257, 1000, 4099, 2 * C.BLOCK_ELEMENTS + 77]


def _cp():
    import cupy
    return cupy


def data(count: int, dtype, seed: int = 0) -> np.ndarray:
    """Normal values with ties (for topk), zeros, and float64 values that float16 and
    float32 round differently from a cast chain."""
    x = np.random.default_rng([seed, count]).standard_normal(count).astype(dtype) * 3
    x[1::5] = -x[0::5][:x[1::5].size]
    x[::11] = 0.0
    if dtype == np.float64 and count > 20:      # halfway cases of float16 / bfloat16
        x[3:13] = (1 + 2.0 ** -11 + 2.0 ** -40 * np.arange(10)) * 2.0 ** np.arange(10)
    return x


def _bytes(payload) -> list[bytes]:
    cp = _cp()
    return [cp.asnumpy(p).tobytes() if isinstance(p, cp.ndarray) else p.tobytes()
            for p in payload]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cupy_codec_equals_numpy_bit_for_bit(spec, dtype):
    cp = _cp()
    host_codec, dev_codec = get_codec(spec), get_codec(spec)
    for rep in range(2):
        for count in COUNTS:
            x = data(count, dtype, seed=rep)
            want = host_codec.encode(x)
            got = dev_codec.encode(cp.asarray(x))
            assert all(isinstance(p, cp.ndarray) for p in got)
            assert _bytes(got) == _bytes(want), (spec, dtype, count)
            y = dev_codec.decode(got, count, dtype)
            assert isinstance(y, cp.ndarray)
            assert cp.asnumpy(y).tobytes() == host_codec.decode(want, count, dtype).tobytes()


@pytest.mark.parametrize("spec", ["int8", "onebit", "topk:0.05", "bf16", "randomk:0.1"])
def test_cupy_payload_staging(spec):
    """Encode on the device into a host payload, decode a host payload into device memory,
    and the byte-buffer forms (to_host_payload / decode_into)."""
    cp = _cp()
    count = 100_003
    x = data(count, np.float32)
    want = get_codec(spec).encode(x)
    codec = get_codec(spec)
    raw, parts = new_payload(codec, count, np.float32)
    codec.encode(cp.asarray(x), out=parts)
    assert _bytes(parts) == _bytes(want)
    out = cp.zeros(count, np.float32)
    codec.decode(parts, count, np.float32, out=out)
    expect = get_codec(spec).decode(want, count, np.float32)
    assert cp.asnumpy(out).tobytes() == expect.tobytes()
    codec = get_codec(spec)
    raw_dev, parts_dev = new_payload(codec, count, np.float32, like=cp.asarray(x))
    codec.encode(cp.asarray(x), out=parts_dev)
    host = codec.to_host_payload(raw_dev)
    assert isinstance(host, np.ndarray) and host.tobytes() == raw.tobytes()
    out2 = cp.zeros(count, np.float32)
    codec.decode_into(host, count, out2)
    assert cp.asnumpy(out2).tobytes() == expect.tobytes()


@pytest.mark.parametrize("spec", ["int8", "onebit", "topk:0.01"])
def test_cupy_round_trip_moves_only_the_payload(spec, monkeypatch):
    """Device vector -> host payload -> device vector: the copies between the sides are
    the payload's bytes, once each way (counted where the codecs make them)."""
    cp = _cp()
    from mpicoll.compression import namespace
    from mpicoll.gpu import array_modules

    moved = {"d2h": 0, "h2d": 0}
    to_host, to_device = namespace.to_host, namespace.to_device

    def counting_to_host(a, out=None):
        if isinstance(a, cp.ndarray):
            moved["d2h"] += a.nbytes
        return to_host(a, out)

    def counting_to_device(host, like, out=None):
        moved["h2d"] += host.nbytes
        return to_device(host, like, out)

    # both names: the codecs call namespace's, and namespace.to_side (decoding a host
    # payload into device memory) calls array_modules' own
    for module in (namespace, array_modules):
        monkeypatch.setattr(module, "to_host", counting_to_host)
        monkeypatch.setattr(module, "to_device", counting_to_device)
    count = 1 << 20
    codec = get_codec(spec)
    x = cp.asarray(data(count, np.float32))
    codec.roundtrip(x)                              # onebit's sign table goes over once
    moved.update(d2h=0, h2d=0)
    raw, parts = new_payload(codec, count, np.float32)
    codec.encode(x, out=parts)
    codec.decode(parts, count, np.float32, out=cp.empty(count, np.float32))
    assert moved == {"d2h": raw.nbytes, "h2d": raw.nbytes}
    assert raw.nbytes < x.nbytes // 3


@pytest.mark.parametrize("spec", ["int8", "onebit", "topk:0.1"])
def test_cupy_error_feedback(spec):
    cp = _cp()
    ch, cd = get_codec(spec), get_codec(spec)
    fh, fd = ErrorFeedback(), ErrorFeedback()
    for step in range(3):
        x = data(5001, np.float32, seed=step)
        assert _bytes(fd.encode(cd, cp.asarray(x), key="w")) == \
            _bytes(fh.encode(ch, x, key="w"))
        res = fd.residual("w")
        assert isinstance(res, cp.ndarray)
        assert cp.asnumpy(res).tobytes() == fh.residual("w").tobytes()


def test_torch_cuda_tensor_goes_through_a_cupy_view():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    cp = _cp()
    x = data(3001, np.float32)
    t = torch.as_tensor(x, device="cuda")
    got = get_codec("onebit").encode(t)
    assert all(isinstance(p, cp.ndarray) for p in got)
    assert _bytes(got) == _bytes(get_codec("onebit").encode(x))
