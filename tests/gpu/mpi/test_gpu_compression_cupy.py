"""GPU: the compressed collectives on CuPy arrays, under mpirun (ranks sharing one GPU).
Skipped, with the reason, without a GPU.

Every result and residual must equal the host run's (numpy arrays, same inputs, same
codec) bit for bit, and stay on the device; only payloads cross to the host (the CPU
version with a fake device module, which counts the bytes, is
tests/compression/mpi/test_compression_device.py).
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from gpu_helpers import gpu_skip_reason
from mpicoll.compression import ErrorFeedback, allgather, allreduce, get_codec, reduce_scatter

_REASON = gpu_skip_reason()
pytestmark = [pytest.mark.mpi, pytest.mark.skipif(_REASON is not None,
                                                  reason=f"GPU tests: {_REASON}")]

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()


@pytest.fixture(scope="module", autouse=True)
def device():
    from mpicoll.gpu.device import select_device
    return select_device()


def _cp():
    import cupy
    return cupy


def _input(count: int, dtype, rep: int = 0) -> np.ndarray:
    rng = np.random.default_rng([RANK, count, rep])
    return (rng.standard_normal(count) * (1 + RANK)).astype(dtype)


def _both(call, x: np.ndarray) -> list[str]:
    """``call(x, fb)`` on numpy and on CuPy, twice (the second call with the first one's
    residual); what differs."""
    cp = _cp()
    fb_host, fb_dev = ErrorFeedback(), ErrorFeedback()
    problems = []
    for rep in range(2):
        want = call(x + rep, fb_host)
        got = call(cp.asarray(x + rep), fb_dev)
        if not isinstance(got, cp.ndarray) or cp.asnumpy(got).tobytes() != want.tobytes():
            problems.append(f"call {rep}: result differs ({type(got).__name__})")
        res = fb_dev.residual("k")
        if not isinstance(res, cp.ndarray) or \
                cp.asnumpy(res).tobytes() != fb_host.residual("k").tobytes():
            problems.append(f"call {rep}: residual differs or is not on the device")
    return problems


def _agreed(problems: list[str], what: str) -> None:
    found = {r: p for r, p in enumerate(COMM.allgather(problems)) if p}
    assert not found, f"{what}: {found}"


@pytest.mark.parametrize("spec,dtype", [("none", np.float64), ("fp16", np.float32),
                                        ("bf16", np.float32), ("int8", np.float32),
                                        ("onebit", np.float64), ("topk:0.1", np.float32),
                                        ("randomk:0.25", np.float32)])
def test_allreduce_cupy_equals_host(spec, dtype):
    x = _input(100_003, dtype)
    # one codec per side: a name's codec is one object per process (random-k's indices
    # follow its encode count, which the other side's calls would advance)
    codec = {True: get_codec(spec), False: get_codec(spec)}
    _agreed(_both(lambda v, fb: allreduce(v, compression=codec[isinstance(v, np.ndarray)],
                                          feedback=fb, key="k", segment_bytes=64 << 10),
                  x), spec)


@pytest.mark.parametrize("spec", ["int8", "topk:0.1"])
def test_reduce_scatter_cupy_equals_host(spec):
    x = _input(50_001, np.float32, 1)
    _agreed(_both(lambda v, fb: reduce_scatter(v, compression=spec, feedback=fb, key="k",
                                               segment_bytes=32 << 10), x), spec)


def test_allgather_cupy_equals_host():
    x = _input(20_011, np.float32, 2)
    _agreed(_both(lambda v, fb: allgather(v, compression="bf16", feedback=fb, key="k"), x),
            "allgather")


def test_default_feedback_and_in_place_on_device():
    """The default per-array residual on a CuPy input, and the in-place form."""
    cp = _cp()
    x = _input(4099, np.float32, 3)
    d = cp.asarray(x)
    first = allreduce(d, compression="int8")
    second = allreduce(d, compression="int8")      # with the residual kept for ``d``
    h = x.copy()
    want1 = allreduce(h, compression="int8")
    want2 = allreduce(h, compression="int8")
    buf = cp.asarray(x)
    inplace = allreduce(None, buf, compression="int8", feedback=False)
    want3 = allreduce(x.copy(), compression="int8", feedback=False)
    ok = (cp.asnumpy(first).tobytes() == want1.tobytes()
          and cp.asnumpy(second).tobytes() == want2.tobytes()
          and inplace is buf and cp.asnumpy(buf).tobytes() == want3.tobytes())
    _agreed([] if ok else ["default feedback or in place differs"], "device defaults")
