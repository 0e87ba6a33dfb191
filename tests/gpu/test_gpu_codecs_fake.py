"""Codecs on "device" arrays, on the CPU: the array-module dispatch with a fake device module.

:class:`doubles.array_module.DevArray` (a numpy subclass standing for device memory) is
handled by :class:`doubles.array_module.FakeDeviceModule` (its device backend registered
through :func:`mpicoll.gpu.backends.registered`), which runs numpy's kernels but refuses
host arrays as their operands (as CuPy refuses numpy arrays) and counts every byte copied
between the sides.
Every codec must give the payload and decoded values of the numpy path bit for bit, keep
the dense vector on the "device", and move only the payload when the payload is on the
other side. The real CuPy comparison is tests/gpu/test_gpu_codecs_cupy.py.
"""
from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest

from mpicoll.compression import ErrorFeedback, get_codec, new_payload
from mpicoll.compression import codecs as C
from mpicoll.compression import namespace

from doubles.array_module import DevArray, FakeDeviceModule, dev, fake_device_module, host_bytes

SPECS = ["none", "fp16", "bf16", "int8", "int8:24", "int8:stochastic", "onebit", "onebit:24",
         "onebit:two", "onebit:24:two",
         "topk:0.05", "topk:1", "randomk:0.1", "randomk:1"]
COUNTS = [0, 1, 7, 8, 9, 255, 257, 1000, 4099]


@pytest.fixture(autouse=True)
def fake_device():
    with fake_device_module() as module:
        yield module


def data(count: int, dtype: Any, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng([seed, count]).standard_normal(count).astype(dtype) * 3
    x[1::5] = -x[0::5][:x[1::5].size]           # equal magnitudes: ties for topk
    x[::11] = 0.0
    if dtype == np.float64 and count > 20:      # float16 halfway cases (+ a hair): a cast
        x[3:13] = (1 + 2.0 ** -11 + 2.0 ** -40 * np.arange(10)) * 2.0 ** np.arange(10)
                                                # through float32 rounds them twice
    return x


def test_dispatch_numpy_without_importing_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)     # any `import cupy` would fail
    for a in (np.zeros(3), np.float32(1), None, 3):
        assert namespace.array_module(a) is np
    assert namespace.array_module(dev(np.zeros(3))) is not np
    x = data(300, np.float32)
    assert get_codec("int8").roundtrip(x).dtype == np.float32


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_device_codec_equals_numpy_bit_for_bit(spec, dtype):
    host_codec, dev_codec = get_codec(spec), get_codec(spec)
    for rep in range(2):                    # stateful codecs advance alike
        for count in COUNTS:
            x = data(count, dtype, seed=rep)
            want = host_codec.encode(x)
            got = dev_codec.encode(dev(x))
            assert all(isinstance(p, DevArray) for p in got)
            assert host_bytes(got) == host_bytes(want), (spec, count)
            y_host = host_codec.decode(want, count, dtype)
            y_dev = dev_codec.decode(got, count, dtype)
            assert isinstance(y_dev, DevArray)
            assert y_dev.view(np.ndarray).tobytes() == y_host.tobytes()
    # the dense vector never crossed; randomk copied only its k indices per encoding,
    # onebit its sign table once
    if spec.startswith("randomk") and spec != "randomk:1":
        assert FakeDeviceModule.d2h == 0 and 0 < FakeDeviceModule.h2d <= 8 * 410 * 2 * 9
    else:
        assert FakeDeviceModule.d2h == 0 and FakeDeviceModule.h2d <= C._SIGN_TABLE.nbytes
    assert FakeDeviceModule.calls      # the kernels ran in the device module


@pytest.mark.parametrize("spec", ["bf16", "int8", "int8:stochastic", "onebit:24"])
def test_whole_vector_on_device_equals_blocked_host(spec):
    """The device runs a vector in one block, the host in BLOCK_ELEMENTS blocks."""
    count = 2 * C.BLOCK_ELEMENTS + 77
    x = data(count, np.float32, seed=9)
    want = get_codec(spec).encode(x)
    got = get_codec(spec).encode(dev(x))
    assert host_bytes(got) == host_bytes(want)


@pytest.mark.parametrize("spec", ["int8", "onebit", "topk:0.05", "fp16", "randomk:0.1"])
def test_only_the_payload_crosses(spec):
    count = 4099
    x = data(count, np.float32)
    codec = get_codec(spec)
    nbytes = codec.wire_bytes(count, np.float32)
    want = get_codec(spec).encode(x)
    get_codec(spec).roundtrip(dev(x))         # onebit's sign table reaches the device once
    raw, parts = new_payload(codec, count, np.float32)            # host payload
    FakeDeviceModule.d2h = FakeDeviceModule.h2d = 0
    codec.encode(dev(x), out=parts)                               # encoded on the device
    assert FakeDeviceModule.d2h == nbytes
    assert host_bytes(parts) == host_bytes(want)
    FakeDeviceModule.d2h = FakeDeviceModule.h2d = 0
    out = dev(np.zeros(count, np.float32))
    assert codec.decode(parts, count, np.float32, out=out) is out
    assert FakeDeviceModule.h2d == nbytes and FakeDeviceModule.d2h == 0
    assert out.view(np.ndarray).tobytes() == \
        get_codec(spec).decode(want, count, np.float32).tobytes()
    # the byte-buffer forms that travel over MPI
    FakeDeviceModule.d2h = FakeDeviceModule.h2d = 0
    codec = get_codec(spec)                   # randomk: the same step as `raw`
    raw_dev, parts_dev = new_payload(codec, count, np.float32, like=dev(x))
    codec.encode(dev(x), out=parts_dev)
    host = codec.to_host_payload(raw_dev)
    assert FakeDeviceModule.d2h == nbytes and host.tobytes() == raw.tobytes()
    out2 = dev(np.zeros(count, np.float32))
    codec.decode_into(host, count, out2)
    assert FakeDeviceModule.h2d == nbytes + (8 * 410 if spec.startswith("randomk") else 0)
    assert out2.view(np.ndarray).tobytes() == out.view(np.ndarray).tobytes()
    assert codec.to_host_payload(raw) is raw                      # host: no copy
    with pytest.raises(ValueError, match="payload of"):
        codec.decode_into(host[:-1], count, out2)


def test_float64_to_float16_through_round_to_odd_float32():
    """What the device path of fp16 uses for float64 input (a device library's double ->
    half cast may round through float32) equals numpy's direct cast."""
    rng = np.random.default_rng(11)
    mant = 1 + rng.integers(0, 1 << 12, 20000) * 2.0 ** -12 + rng.integers(-3, 4, 20000) * \
        2.0 ** -45
    x = mant * 2.0 ** rng.integers(-30, 18, 20000) * rng.choice([-1, 1], 20000)
    x = np.concatenate([x, [0.0, -0.0, np.inf, -np.inf, np.nan, 1e300, -1e-300, 65520.0]])
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
        got = C._round_to_odd_float32(FakeDeviceModule(), dev(x)).view(np.ndarray)
        assert got.astype(np.float16).tobytes() == want.tobytes()
        assert (x.astype(np.float32).astype(np.float16) != want).sum() > 100  # it matters


def test_host_array_in_a_device_kernel_is_refused():
    """The fake is strict, so the tests above would catch a host temporary."""
    with pytest.raises(TypeError, match="host array in a device kernel"):
        np.add(dev(np.zeros(3)), np.zeros(3))


@pytest.mark.parametrize("spec", ["int8", "onebit", "topk:0.1"])
def test_error_feedback_on_device(spec):
    codec_h, codec_d = get_codec(spec), get_codec(spec)
    fb_h, fb_d = ErrorFeedback(), ErrorFeedback()
    for step in range(3):
        x = data(1001, np.float32, seed=step)
        ph = fb_h.encode(codec_h, x, key="w")
        pd = fb_d.encode(codec_d, dev(x), key="w")
        assert host_bytes(pd) == host_bytes(ph)
        res = fb_d.residual("w")
        assert isinstance(res, DevArray)
        assert res.view(np.ndarray).tobytes() == fb_h.residual("w").tobytes()
    assert FakeDeviceModule.d2h == 0
    with pytest.raises(ValueError, match="is a fakedevice array but the tensor is in host"):
        fb_d.compensate("w", x)
