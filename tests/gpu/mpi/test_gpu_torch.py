"""GPU: torch CUDA tensors through every mpicoll.torch op and DistributedOptimizer, under
mpirun (1, 2 and 4 ranks sharing one GPU); skipped, with the reason, without CUDA.

The ops and data are those of the simulated-device suite (tests/torch/mpi/
test_torch_device.py): small integers, so every result must equal the same op on CPU
tensors bit for bit. Runs with the staged path (the MPI wheels are not CUDA-aware).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from gpu_helpers import torch_cuda_skip_reason

_REASON = torch_cuda_skip_reason()
pytestmark = [pytest.mark.mpi, pytest.mark.skipif(_REASON is not None,
                                                  reason=f"GPU tests: {_REASON}")]

_SPEC = importlib.util.spec_from_file_location(
    "torch_device_ops", Path(__file__).resolve().parents[2] / "torch" / "mpi" /
    "test_torch_device.py")


@pytest.fixture(scope="module")
def hvd():
    import torch

    import mpicoll.torch as hvd

    hvd.init()
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    yield hvd
    hvd.shutdown()


@pytest.fixture(scope="module")
def ops():
    module = importlib.util.module_from_spec(_SPEC)
    _SPEC.loader.exec_module(module)
    return module


@pytest.mark.parametrize("placement", ["all", "alternate"])
def test_cuda_tensors_equal_the_cpu_reference(hvd, ops, placement: str) -> None:
    import torch

    rank, size = hvd.rank(), hvd.size()
    on_device = placement == "all" or rank % 2 == 0
    cuda = (lambda t: t.cuda()) if on_device else (lambda t: t)
    got = [ops._ops(cuda, rank, size, rep) for rep in range(2)]
    want = [ops._ops(lambda t: t, rank, size, rep) for rep in range(2)]
    for g, w in zip(got, want):
        for key in w:
            for x, y in zip(ops._flatten(g[key]), ops._flatten(w[key])):
                assert x.dtype == y.dtype and x.shape == y.shape, key
                assert torch.equal(x.cpu(), y), key
            results = ops._flatten(g[key][0] if key == "alltoall" else g[key])
            assert all(x.is_cuda == on_device for x in results), key


def test_results_ready_on_another_stream(hvd) -> None:
    """A tensor written on a side stream, reduced, read on that stream: the submit-time
    event and the engine's synchronisation order it."""
    import torch

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.full((1 << 20,), float(hvd.rank() + 1), device="cuda")
        x.mul_(2)                                 # still queued when the op is submitted
        y = hvd.allreduce(x, op=hvd.Sum, name="gpu.stream")
        total = float(y.sum())
    want = 2 * sum(r + 1 for r in range(hvd.size())) * (1 << 20)
    assert total == want


def test_distributed_optimizer_on_cuda(hvd) -> None:
    """One step on CUDA parameters equals the same step on CPU parameters."""
    import torch

    def step(device: str) -> list:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4).to(device)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                       named_parameters=model.named_parameters())
        x = (torch.arange(16, dtype=torch.float32).view(2, 8) + hvd.rank()).to(device)
        model(x).sum().backward()
        opt.step()
        return [p.detach().cpu() for p in model.parameters()]

    for a, b in zip(step("cuda"), step("cpu")):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)


@pytest.fixture
def small_chunks(hvd, monkeypatch):
    """Staging chunks of 4 KiB (tensors of ``big=600`` span many); the engine's settings
    read again before and after (every rank alike)."""
    from mpicoll import config
    from mpicoll.torch.engine import pipeline
    from mpicoll.torch.state import engine

    monkeypatch.setenv("MPICOLL_STAGING_CHUNK_BYTES", "4096")
    config.refresh()                   # mpicoll.gpu reads it through mpicoll.config
    pipeline.forget(engine())
    yield
    monkeypatch.undo()                 # the settings read again are the suite's own
    config.refresh()
    pipeline.forget(engine())


@pytest.mark.parametrize("placement", ["all", "alternate"])
def test_chunked_cuda_tensors_equal_the_cpu_reference(hvd, ops, placement: str,
                                                      small_chunks, monkeypatch) -> None:
    """Every op on tensors of many 4 KiB chunks: the chunked pipeline on CUDA streams
    (d2h copies counted) equals the CPU reference bit for bit."""
    import torch

    from mpicoll.torch.device.cuda_copies import CudaCopies

    copied = []
    real = CudaCopies.d2h
    monkeypatch.setattr(CudaCopies, "d2h",
                        lambda self, dst, src, k: (copied.append(k), real(self, dst, src, k)))
    rank, size = hvd.rank(), hvd.size()
    on_device = placement == "all" or rank % 2 == 0
    cuda = (lambda t: t.cuda()) if on_device else (lambda t: t)
    got = [ops._ops(cuda, rank, size, rep, 600) for rep in range(2)]
    want = [ops._ops(lambda t: t, rank, size, rep, 600) for rep in range(2)]
    for g, w in zip(got, want):
        for key in w:
            for x, y in zip(ops._flatten(g[key]), ops._flatten(w[key])):
                assert torch.equal(x.cpu(), y), key
    if on_device and size > 1:
        assert len(copied) > 100 and max(copied) > 4


def test_distributed_optimizer_flat_cuda_buffers(hvd, small_chunks, monkeypatch) -> None:
    """Bulk mode: CUDA parameters' gradients are views of one flat CUDA buffer, submitted
    as one request per step; the steps equal the CPU model's."""
    import torch

    from mpicoll.torch.state import engine

    eng = engine()
    saved = eng.bulk_gradients
    eng.bulk_gradients = True
    submitted = []
    real = type(eng).submit

    def counting(self, meta, *args, **kwargs):
        submitted.append(meta.name)
        return real(self, meta, *args, **kwargs)

    monkeypatch.setattr(type(eng), "submit", counting)

    def train(device: str) -> tuple:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 4)).to(device)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters())
        for step in range(3):
            opt.zero_grad()
            x = torch.arange(128, dtype=torch.float32).view(2, 64) / 128 + hvd.rank() + step
            model(x.to(device)).sum().backward()
            opt.step()
        return [p.detach().cpu() for p in model.parameters()], opt

    try:
        got, opt = train("cuda")
        assert [f.buffer.is_cuda for f in opt._flat] == [True]
        assert all(p.grad.data_ptr() == v.data_ptr() for p, v in opt._views.items())
        assert submitted == ["allreduce.__gradients__.float32"] * 3
        want, _ = train("cpu")
    finally:
        eng.bulk_gradients = saved
    for a, b in zip(got, want):                      # cuBLAS and CPU GEMMs round apart
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)
