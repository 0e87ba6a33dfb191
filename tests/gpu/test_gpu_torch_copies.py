"""GPU, one process: the core's staged pipeline on torch CUDA tensors through
:class:`mpicoll.torch.device.cuda_copies.CudaCopies` (torch's streams and events, no CuPy).
Skipped, with the reason, without torch CUDA."""
from __future__ import annotations

import pytest

from gpu_helpers import SimulatedWorld, torch_cuda_skip_reason
from mpicoll import IN_PLACE
from mpicoll.gpu import staging
from mpicoll.gpu.slots import HostSlots

_REASON = torch_cuda_skip_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"GPU tests: {_REASON}")

N = 1 << 20


def _device():
    import torch

    from mpicoll.torch.device.tensors import CudaDevice

    dev = CudaDevice(torch.cuda.current_device())
    return dev, dev.copies(HostSlots(dev.pinned))


def _late_input(dev):
    """``2 * arange(N)``, written on the engine's stream behind a ~50 ms sleep: a copy
    stream that did not wait for the engine's stream would read ``arange`` or garbage."""
    import torch

    with dev.stream():
        x = torch.arange(N, dtype=torch.float32, device=dev.name)
        torch.cuda._sleep(50_000_000)
        x.mul_(2)
    return x


def test_chunked_allreduce_waits_for_the_engine_stream() -> None:
    import torch

    dev, copies = _device()
    x = _late_input(dev)
    calls = []

    def host(args: tuple) -> None:                  # (IN_PLACE, slot view, op)
        view = args[1]        # not `args[1] *= 3`: that also assigns into the tuple
        calls.append(view.size)
        view *= 3

    staging.staged("allreduce", (IN_PLACE, x, None), host, comm=SimulatedWorld(1).comm(0),
                   copies=copies, chunk_bytes=64 << 10, staging_limit=1 << 20)
    want = torch.arange(N, dtype=torch.float32) * 6
    assert torch.equal(x.cpu(), want)               # ready when staged returns
    assert len(calls) == N * 4 // (64 << 10) and sum(calls) == N


def test_chunked_allgather_and_broadcast() -> None:
    import torch

    dev, copies = _device()
    x = _late_input(dev)
    out = dev.empty((N,), torch.float32, event=dev.record())
    staging.staged("allgather", (x, out), lambda args: None,
                   comm=SimulatedWorld(1).comm(0), copies=copies, chunk_bytes=64 << 10)
    assert torch.equal(out.cpu(), torch.arange(N, dtype=torch.float32) * 2)
    y = torch.zeros(N, dtype=torch.float32, device=dev.name)

    def received(args: tuple) -> None:              # (slot view, root) off the root
        args[0][...] = 7

    staging.staged("broadcast", (y, 0), received, comm=SimulatedWorld(2).comm(1),
                   copies=copies, chunk_bytes=64 << 10)
    assert torch.equal(y.cpu(), torch.full((N,), 7.0))
