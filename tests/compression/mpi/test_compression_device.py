"""The compressed collectives on "device" arrays, on the CPU.

tests/doubles/array_module.py's fake device module (``DevArray``: a numpy subclass
whose kernels refuse host operands, every copy between the sides counted) stands for CuPy:
the result and the residual must equal the host run's bit for bit, stay on the "device",
and the bytes copied device -> host must be exactly the payloads this rank encoded (never
the dense vector). The CuPy version is tests/gpu/mpi/test_gpu_compression_cupy.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from mpicoll.compression import (ErrorFeedback, allgather, allreduce, get_codec, last_stats,
                                 reduce_scatter)

from compression_cases import (RANK, SIZE, block_segments, gather, make_input,
                               split_bounds)
from doubles.array_module import DevArray, FakeDeviceModule, dev, fake_device_module

pytestmark = pytest.mark.mpi


@pytest.fixture(autouse=True)
def fake_device():
    with fake_device_module() as module:
        yield module


def host(a) -> bytes:
    return a.view(np.ndarray).tobytes()


def agreed(problems: list[str], what: str) -> None:
    found = {r: p for r, p in enumerate(gather(problems)) if p}
    assert not found, f"{what}: " + "; ".join(f"rank {r}: {', '.join(p)}"
                                              for r, p in found.items())


def encoded_bytes(spec: str, count: int, dtype, segment: int, blocks) -> int:
    """Wire bytes of this rank's encodings of ``blocks`` (whole blocks for sparse codecs,
    segment by segment for dense ones)."""
    codec = get_codec(spec)
    total = 0
    for b in blocks:
        sb = block_segments(count, SIZE, b, segment, dtype) if codec.dense else \
            split_bounds(count, SIZE)[b:b + 2]
        total += sum(codec.wire_bytes(sb[j + 1] - sb[j], dtype) for j in range(len(sb) - 1))
    return total


def run_both(call, x: np.ndarray, calls: int = 2) -> tuple[list[str], object, object, int]:
    """``call(x, fb)`` on the host and on the device (``calls`` calls each, a second one
    with the first one's residual); returns (problems, host result, device result, d2h
    bytes of the last device call)."""
    fb_host, fb_dev = ErrorFeedback(), ErrorFeedback()
    problems = []
    for rep in range(calls):
        want = call(x + rep, fb_host)
        FakeDeviceModule.d2h = 0
        got = call(dev(x + rep), fb_dev)
        d2h = FakeDeviceModule.d2h
        if not isinstance(got, DevArray) or host(got) != want.tobytes():
            problems.append(f"call {rep}: result differs from the host run ({type(got)})")
        res = fb_dev.residual("k")
        if not isinstance(res, DevArray) or host(res) != fb_host.residual("k").tobytes():
            problems.append(f"call {rep}: residual differs or is not on the device")
    return problems, want, got, d2h


@pytest.mark.parametrize("spec,dtype", [
    ("none", np.float64), ("fp16", np.float32), ("bf16", np.float32), ("int8:4", np.float32),
    ("onebit:8", np.float64), ("topk:0.2", np.float32), ("randomk:0.25", np.float32)])
def test_allreduce_on_device_equals_host_and_moves_only_payloads(spec, dtype):
    count, segment = 601, 512
    x = make_input(RANK, count, 0, dtype)
    # one codec per side: a name's codec is one object per process, and random-k's
    # indices follow its encode count, which the other side's calls would advance
    codec = {True: get_codec(spec), False: get_codec(spec)}
    problems, _, _, d2h = run_both(
        lambda v, fb: allreduce(v, compression=codec[isinstance(v, DevArray)], feedback=fb,
                                key="k",
                                segment_bytes=segment,
                                # auto: flat on the device, node on emulated nodes on the host
                                layout="auto" if isinstance(v, DevArray) else "flat"), x,
        2 if spec in ("int8:4", "topk:0.2") else 1)
    stats = last_stats()
    if stats.layout != "flat":
        problems.append(f"layout {stats.layout} (auto must be flat for device arrays)")
    # every block is encoded once by every rank (sparse: the whole vector once)
    want = encoded_bytes(spec, count, dtype, segment, range(SIZE)) if get_codec(spec).dense \
        else get_codec(spec).wire_bytes(count, dtype)
    if d2h != want:
        problems.append(f"{d2h} bytes device -> host, the payloads are {want}")
    agreed(problems, spec)


@pytest.mark.parametrize("spec", ["int8", "topk:0.3"])
def test_reduce_scatter_on_device(spec):
    count, segment = 301, 128
    x = make_input(RANK, count, 1, np.float32)
    problems, _, _, d2h = run_both(
        lambda v, fb: reduce_scatter(v, compression=spec, feedback=fb, key="k",
                                     segment_bytes=segment), x)
    want = encoded_bytes(spec, count, np.float32, segment,
                         [b for b in range(SIZE) if b != RANK])
    if d2h != want:
        problems.append(f"{d2h} bytes device -> host, the payloads are {want}")
    agreed(problems, spec)


def test_allgather_on_device():
    x = make_input(RANK, 37, 2, np.float32)
    problems, _, _, d2h = run_both(
        lambda v, fb: allgather(v, compression="int8", feedback=fb, key="k"), x)
    if d2h != get_codec("int8").wire_bytes(37, np.float32):
        problems.append(f"{d2h} bytes device -> host")
    agreed(problems, "allgather")


def test_device_errors_on_every_rank():
    x = dev(make_input(RANK, 40, 0, np.float32))
    with pytest.raises(ValueError, match="layout='node' takes host arrays only"):
        allreduce(x, compression="int8", layout="node")
    with pytest.raises(TypeError, match="recvbuf is in host memory but sendbuf is a "
                                        "fakedevice array"):
        allreduce(x, np.empty(40, np.float32), compression="int8")
