"""GPU, one process: CuPy copies, real streams overlapping, device arrays recognised.
Skipped, with the reason, without a GPU."""
from __future__ import annotations

import time

import numpy as np
import pytest

from gpu_helpers import SimulatedWorld, gpu_skip_reason
from mpicoll.gpu import arrays, staging

_REASON = gpu_skip_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"GPU tests: {_REASON}")


def test_cupy_arrays_are_device_arrays() -> None:
    import cupy as cp
    x = cp.arange(10, dtype=cp.float32)
    assert arrays.is_device(x) and arrays.device_id(x) == x.device.id
    assert arrays.producer_stream(x) == cp.cuda.get_current_stream().ptr
    with pytest.raises(ValueError, match="must be contiguous"):
        arrays.check_contiguous(cp.zeros((4, 6))[:, ::2], "sendbuf")


def test_torch_cuda_tensors_are_device_arrays() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    t = torch.ones(8, device="cuda")
    assert arrays.is_device(t) and not arrays.is_device(torch.ones(8))
    assert arrays.producer_stream(t) == torch.cuda.current_stream().cuda_stream
    with pytest.raises(ValueError, match="must be contiguous"):
        arrays.check_contiguous(torch.ones(4, 6, device="cuda")[:, ::2], "recvbuf")


def test_pinned_slots_and_round_trip() -> None:
    import cupy as cp
    from mpicoll.gpu.cupy_copies import CupyCopies, pinned_empty
    buf = pinned_empty(1 << 20)
    assert buf.nbytes == 1 << 20
    copies = CupyCopies(cp.cuda.runtime.getDevice())
    x = cp.arange(1000, dtype=cp.float64)
    h = np.zeros(1000)
    copies.begin([x])
    copies.d2h(h, x, 0)
    copies.wait(copies.record("d2h", 0))
    np.testing.assert_array_equal(h, np.arange(1000.0))
    y = cp.zeros_like(x)
    copies.h2d(y, h * 2, 0)
    copies.finish(copies.record("h2d", 0))
    np.testing.assert_array_equal(cp.asnumpy(y), np.arange(1000.0) * 2)


def test_real_streams_overlap_the_host_calls() -> None:
    """While the host 'collective' of chunk k sleeps, the d2h copy of chunk k+1 finishes:
    its event is already complete when the host call ends."""
    import cupy as cp
    from mpicoll.gpu.cupy_copies import CupyCopies

    class Watching(CupyCopies):
        def record(self, stream, chunk):
            event = super().record(stream, chunk)
            self.events[(stream, chunk)] = event
            return event

    copies = Watching(cp.cuda.runtime.getDevice())
    copies.events = {}
    x = cp.ones(8 << 20, cp.float32)  # 32 MiB, 8 chunks of 4 MiB
    seen: list[bool] = []
    calls = [0]

    def host(args):
        k = calls[0]
        calls[0] += 1
        time.sleep(0.02)
        nxt = copies.events.get(("d2h", k + 1))
        if nxt is not None:
            seen.append(nxt.done)

    out = staging.staged("allreduce", (x, None, "sum"), host,
                         comm=SimulatedWorld(1).comm(0), copies=copies,
                         chunk_bytes=4 << 20)
    assert calls[0] == 8 and len(seen) == 7 and all(seen), seen
    assert float(out.sum()) == 8 << 20  # host did nothing: the input came back


def test_select_device_makes_it_current() -> None:
    import cupy as cp
    from mpicoll.gpu.device import select_device
    ordinal = select_device(0)
    assert cp.cuda.runtime.getDevice() == ordinal
