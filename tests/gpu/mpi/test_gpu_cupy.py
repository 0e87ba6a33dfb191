"""GPU: CuPy arrays and torch CUDA tensors through every collective and algorithm, under
mpirun (1, 2 and 4 ranks sharing one GPU). Skipped, with the reason, without a GPU.

Results are compared bit for bit with the host reference (small integers, exact in
float32 whatever the summation order).
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
from gpu_helpers import gpu_skip_reason, rank_data, reference
from mpicoll import IN_PLACE
from mpicoll.gpu import detect, route
from mpicoll.partition import block_bounds

_REASON = gpu_skip_reason()
pytestmark = [pytest.mark.mpi, pytest.mark.skipif(_REASON is not None,
                                                  reason=f"GPU tests: {_REASON}")]

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
PUBLIC = {"allreduce": mpicoll.allreduce, "reduce_scatter": mpicoll.reduce_scatter,
          "allgather": mpicoll.allgather, "broadcast": mpicoll.broadcast,
          "reduce": mpicoll.reduce}
CASES = [(c, a) for c in PUBLIC for a in mpicoll.algorithms(c)]
STAGED = (False, "test: staged path")


@pytest.fixture(scope="module", autouse=True)
def device():
    from mpicoll.gpu.device import select_device
    return select_device()


def _cp():
    import cupy
    return cupy


def _args(collective: str, x, count: int, dtype, algorithm: str, xp):
    root = SIZE - 1
    if collective == "allreduce":
        return (x, None, "sum", algorithm), None
    if collective == "reduce":
        return (x, None, "sum", root, algorithm), None
    if collective == "broadcast":
        buf = x if RANK == root else xp.zeros(count, dtype)
        return (buf, root, algorithm), buf
    if collective == "reduce_scatter":
        b = block_bounds(count, SIZE)
        y = xp.zeros(b[RANK + 1] - b[RANK], dtype)
        return (x, y, "sum", algorithm), y
    y = xp.zeros(count * SIZE, dtype)
    return (x, y, algorithm), y


def _check(collective: str, out, inputs: list, to_numpy) -> None:
    want = reference(collective, inputs, RANK, SIZE - 1)
    if want is None:
        assert out is None
        return
    got = to_numpy(out).reshape(-1)
    assert got.tobytes() == want.tobytes(), f"{collective}: {got[:8]} != {want[:8]}"


@pytest.mark.parametrize("collective,algorithm", CASES)
def test_staged_every_collective_and_algorithm_cupy(collective, algorithm) -> None:
    cp = _cp()
    for count, chunk in ((0, None), (1, None), (SIZE + 1, None), (4099, 1024),
                         (300_001, None)):
        for rep in range(2):
            inputs = [rank_data(r, count, np.float32, rep) for r in range(SIZE)]
            x = cp.asarray(inputs[RANK])
            args, given = _args(collective, x, count, np.float32, algorithm, cp)
            done, out = route.device_call(collective, args, None, None, PUBLIC[collective],
                                          aware=STAGED, chunk_bytes=chunk)
            assert done
            if given is not None:
                assert out is given
            if out is not None:
                assert isinstance(out, cp.ndarray) and out.device.id == x.device.id
            _check(collective, out, inputs, cp.asnumpy)


def test_staged_in_place_and_int_dtypes() -> None:
    cp = _cp()
    inputs = [rank_data(r, 10_000, np.int32) for r in range(SIZE)]
    buf = cp.asarray(inputs[RANK])
    route.device_call("allreduce", (IN_PLACE, buf, "sum", "auto"), None, None,
                      mpicoll.allreduce, aware=STAGED, chunk_bytes=4096)
    _check("allreduce", buf, inputs, cp.asnumpy)
    y = cp.zeros(10_000 * SIZE, np.int32)
    y[RANK * 10_000:(RANK + 1) * 10_000] = cp.asarray(inputs[RANK])
    route.device_call("allgather", (IN_PLACE, y, "auto"), None, None, mpicoll.allgather,
                      aware=STAGED, chunk_bytes=4096)
    _check("allgather", y, inputs, cp.asnumpy)


def test_producer_stream_is_waited_for() -> None:
    """Input written by a kernel on a non-default stream, still running when the call
    starts: the copy streams wait for it."""
    cp = _cp()
    count = 1 << 22
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        x = cp.zeros(count, cp.float32)
        for _ in range(20):  # keep the stream busy
            x = x * 1.0
        x += RANK + 1
        done, out = route.device_call("allreduce", (x, None, "sum", "auto"), None, None,
                                      mpicoll.allreduce, aware=STAGED)
    want = SIZE * (SIZE + 1) / 2
    assert float(out.min()) == want and float(out.max()) == want


def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch


def test_torch_cuda_tensors_staged() -> None:
    torch = _torch_cuda()
    dev = torch.device("cuda", torch.cuda.current_device())
    inputs = [rank_data(r, 5000, np.float32) for r in range(SIZE)]
    x = torch.from_numpy(inputs[RANK]).to(dev)
    done, out = route.device_call("allreduce", (x, None, "sum", "auto"), None, None,
                                  mpicoll.allreduce, aware=STAGED, chunk_bytes=4096)
    assert isinstance(out, torch.Tensor) and out.device == x.device
    _check("allreduce", out, inputs, lambda t: t.cpu().numpy())
    b = block_bounds(5000, SIZE)
    y = torch.zeros(b[RANK + 1] - b[RANK], device=dev)
    route.device_call("reduce_scatter", (x, y, "sum", "auto"), None, None,
                      mpicoll.reduce_scatter, aware=STAGED, chunk_bytes=4096)
    _check("reduce_scatter", y, inputs, lambda t: t.cpu().numpy())
    done, out = route.device_call("allgather", (x, None, "auto"), None, None,
                                  mpicoll.allgather, aware=STAGED)
    assert isinstance(out, torch.Tensor) and out.shape == (5000 * SIZE,)
    _check("allgather", out, inputs, lambda t: t.cpu().numpy())


@pytest.mark.skipif(not hasattr(mpicoll.collectives, "_any_device"),
                    reason="the dispatch hook (docs/gpu.md) is not applied to "
                           "mpicoll.collectives yet")
@pytest.mark.parametrize("collective", list(PUBLIC))
def test_public_api_takes_cupy_arrays(collective: str) -> None:
    cp = _cp()
    inputs = [rank_data(r, 70_001, np.float32) for r in range(SIZE)]
    x = cp.asarray(inputs[RANK])
    args, _ = _args(collective, x, 70_001, np.float32, "auto", cp)
    *data, algorithm = args
    out = PUBLIC[collective](*data, algorithm=algorithm)
    _check(collective, out, inputs, cp.asnumpy)


@pytest.mark.skipif(not detect.cuda_aware()[0],
                    reason=f"MPI is not CUDA-aware here ({detect.cuda_aware()[1]})")
def test_cuda_aware_path_copies_nothing_to_the_host(monkeypatch) -> None:
    cp = _cp()
    d2h: list[str] = []
    real_async, real_sync = cp.cuda.runtime.memcpyAsync, cp.cuda.runtime.memcpy

    def spy_async(dst, src, size, kind, stream):
        if kind in (2, 4):  # DeviceToHost, Default (may be either)
            d2h.append(f"memcpyAsync kind {kind} of {size} B")
        return real_async(dst, src, size, kind, stream)

    def spy_sync(dst, src, size, kind):
        if kind in (2, 4):
            d2h.append(f"memcpy kind {kind} of {size} B")
        return real_sync(dst, src, size, kind)

    monkeypatch.setattr(cp.cuda.runtime, "memcpyAsync", spy_async)
    monkeypatch.setattr(cp.cuda.runtime, "memcpy", spy_sync)
    monkeypatch.setattr(cp.cuda, "alloc_pinned_memory",
                        lambda n: pytest.fail("pinned memory allocated"))
    inputs = [rank_data(r, 1 << 20, np.float32) for r in range(SIZE)]
    x = cp.asarray(inputs[RANK])
    cp.cuda.get_current_stream().synchronize()
    d2h.clear()
    staged, args = route.device_call("allreduce", (x, None, "sum", "auto"), None, None,
                                     mpicoll.allreduce)
    assert not staged
    out = mpicoll.allreduce(*args[:3], algorithm=args[3])
    assert not d2h, d2h
    monkeypatch.undo()
    _check("allreduce", out, inputs, cp.asnumpy)
