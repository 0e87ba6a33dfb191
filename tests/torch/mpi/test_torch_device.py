"""Device tensors through mpicoll.torch, on the CPU: a simulated device
(:class:`doubles.torch_device.SimulatedDevice`, registered through
:func:`mpicoll.torch.device.tensors.registered`) whose tensors the engine stages
through (simulated) pinned host memory, or hands to the collective directly as CUDA-aware
MPI would. Every op equals the same op on host tensors bit for bit, results stay on the
device, and ranks that disagree (device here, host there) still agree on the data.

Each test runs all its collectives before its first assertion (a rank that failed early
would leave the others waiting).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from mpi4py import MPI

import mpicoll.torch as hvd
from mpicoll import collectives, config
from mpicoll.gpu import staging
from mpicoll.torch.device import tensors as device
from mpicoll.torch.engine import pipeline

from doubles.torch_device import SimulatedDevice

pytestmark = pytest.mark.mpi

#: Which ranks put their tensors on the device: all, or every other one (disagreement).
PLACEMENTS = ["all", "alternate"]

_SPEC = importlib.util.spec_from_file_location(     # the core pipeline's order check
    "gpu_helpers", Path(__file__).resolve().parents[2] / "gpu" / "gpu_helpers.py")
_GPU_HELPERS = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_GPU_HELPERS)


def data(rank: int, shape: tuple, dtype: torch.dtype, rep: int = 0) -> torch.Tensor:
    """Small integers depending on rank, element index and repetition (exact sums)."""
    n = 1
    for d in shape:
        n *= d
    idx = torch.arange(n, dtype=torch.int64)
    return ((idx * 3 + rank * 5 + rep * 7) % 11 - 5).to(dtype).view(shape)


def _ops(place, rank: int, size: int, rep: int, big: int = 1) -> dict:
    """Every op, on tensors made by ``place`` (host or device); names fixed per rep.
    ``big`` multiplies dimension 0 of every tensor (``big > 1``: many staging chunks)."""
    out = {}
    a = place(data(rank, (5 * big, 3), torch.float32, rep))
    b = place(data(rank, (7 * big,), torch.float32, rep + 1))
    c = place(data(rank, (4 * big,), torch.bfloat16, rep + 2))
    handles = [hvd.allreduce_async(a, name=f"dev.a.{rep}", op=hvd.Sum),
               hvd.allreduce_async(b, name=f"dev.b.{rep}", op=hvd.Average),
               hvd.allreduce_async(c, name=f"dev.c.{rep}", op=hvd.Sum)]
    if big > 1:                                   # scaled, alone (not fused with a, b, c)
        handles.append(hvd.allreduce_async(place(data(rank, (3 * big,), torch.float64, rep)),
                                           name=f"dev.scaled.{rep}", op=hvd.Average,
                                           prescale_factor=0.5, postscale_factor=3.0))
    out["allreduce"] = [hvd.synchronize(h) for h in handles]
    inplace = place(data(rank, (6 * big,), torch.int32, rep))
    hvd.allreduce_(inplace, name=f"dev.inplace.{rep}", op=hvd.Sum)
    out["allreduce_"] = inplace
    out["grouped"] = hvd.grouped_allreduce([place(data(rank, (3 * big,), torch.float64, rep)),
                                            place(data(rank, (2 * big, 2), torch.float64,
                                                       rep))],
                                           name=f"dev.group.{rep}", op=hvd.Sum)
    out["allgather"] = hvd.allgather(place(data(rank, ((rank + 1) * big, 2), torch.int64,
                                                rep)),
                                     name=f"dev.gather.{rep}")
    out["allgather_even"] = hvd.allgather(place(data(rank, (2 * big, 3), torch.bfloat16,
                                                     rep)),
                                          name=f"dev.gather_even.{rep}")
    bcast = place(data(rank, (3 * big, 2), torch.float32, rep))
    hvd.broadcast_(bcast, root_rank=size - 1, name=f"dev.bcast.{rep}")
    out["broadcast_"] = bcast
    splits = [((rank + dst) % 2 + 1) * big for dst in range(size)]
    out["alltoall"] = hvd.alltoall(place(data(rank, (sum(splits), 2), torch.float32, rep)),
                                   splits=splits, name=f"dev.a2a.{rep}")
    out["reducescatter"] = hvd.reducescatter(place(data(rank, ((size + 1) * big, 2),
                                                        torch.float32, rep)),
                                             op=hvd.Sum, name=f"dev.rs.{rep}")
    return out


def _flatten(value) -> list:
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flatten(v)]
    return [value]


def _device_vs_host(placement: str, aware: bool, big: int = 1) -> tuple:
    """Every op twice on the simulated device (on this rank, per ``placement``), then on
    host tensors under the same names; asserts they are equal bit for bit and that the
    results stay where the arguments were. Returns (device, whether this rank used it)."""
    rank, size = hvd.rank(), hvd.size()
    dev = SimulatedDevice(aware=aware)
    on_device = placement == "all" or rank % 2 == 0
    with device.registered(dev):
        got = [_ops(dev.tensor if on_device else (lambda t: t), rank, size, rep, big)
               for rep in range(2)]                  # twice: reused buffers and views
    want = [_ops(lambda t: t, rank, size, rep, big) for rep in range(2)]
    for g, w in zip(got, want):
        for key in w:
            for x, y in zip(_flatten(g[key]), _flatten(w[key])):
                assert x.dtype == y.dtype and x.shape == y.shape, key
                assert torch.equal(x.as_subclass(torch.Tensor), y), key
            results = _flatten(g[key][0] if key == "alltoall" else g[key])  # not its splits
            assert all(dev.claims(x) == on_device for x in results), key
    return dev, on_device


@pytest.mark.parametrize("aware", [False, True], ids=["staged", "aware"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_every_op_equals_the_host_reference(placement: str, aware: bool) -> None:
    size = hvd.size()
    dev, on_device = _device_vs_host(placement, aware)
    assert not dev.pipeline.log                       # one chunk each: not chunked
    if on_device and size > 1:
        staged = dev.ops("d2h", "h2d")
        assert bool(staged) != aware, staged
        assert bool(dev.ops("buffer")) == aware
    assert bool(dev.ops("sync")) == on_device


def test_fused_allreduce_stages_once_and_waits_for_the_caller_stream() -> None:
    """Three tensors fused: packed on the device, one d2h and one h2d of the fusion
    buffer; the engine waits for each tensor's submit-time event, so data the caller's
    stream writes late is what gets reduced."""
    rank, size = hvd.rank(), hvd.size()
    dev = SimulatedDevice()
    with device.registered(dev):
        tensors = [dev.tensor(torch.zeros(n)) for n in (4, 5, 6)]
        for i, t in enumerate(tensors):
            dev.on_caller_stream(lambda t=t, i=i: t.copy_(data(rank, t.shape, t.dtype, i)))
        group = hvd.grouped_allreduce_async(tensors, name="dev.fused", op=hvd.Sum)
        results = hvd.synchronize(group)
    for i, (t, r) in enumerate(zip(tensors, results)):
        want = sum(data(q, t.shape, t.dtype, i) for q in range(size))
        assert torch.equal(r.as_subclass(torch.Tensor), want)
        assert dev.claims(r)
    assert dev.pending() == 0
    log = dev.log
    assert log[0][0] == "record" and ("wait", log[0][1]) in log
    if size > 1:
        assert [e[0] for e in dev.ops("d2h", "h2d")] == ["d2h", "h2d"]
        assert dev.ops("d2h")[0][1] == 15 * 4
        assert log.index(("wait", log[0][1])) < log.index(dev.ops("d2h")[0])
        assert log[-1] == ("sync",)


#: Bytes of one staging chunk in the chunked tests: every tensor of ``_ops(big=BIG)``
#: spans several chunks.
CHUNK_BYTES = "64"
BIG = 7


@pytest.fixture
def small_chunks(monkeypatch):
    """Staging chunks of :data:`CHUNK_BYTES` (the engine's settings read again before and
    after, every rank alike)."""
    from mpicoll.torch.state import engine

    monkeypatch.setenv("MPICOLL_STAGING_CHUNK_BYTES", CHUNK_BYTES)
    config.refresh()                   # mpicoll.gpu reads it through mpicoll.config
    pipeline.forget(engine())
    yield
    monkeypatch.undo()                 # the settings read again are the suite's own
    config.refresh()
    pipeline.forget(engine())


@pytest.mark.parametrize("placement,aware", [("all", False), ("alternate", False),
                                             ("all", True)],
                         ids=["staged", "staged-alternate", "aware"])
def test_chunked_ops_equal_the_host_reference(placement: str, aware: bool,
                                              small_chunks) -> None:
    """Tensors of many chunks: staged ranks pipeline every all-reduce (Average, pre- and
    postscale, grouped, in place), all-gather, broadcast and reduce-scatter through the
    core's staged path; host ranks make the same chunked host calls; all-to-all is staged
    in one piece. Bit for bit the host results. Nobody stages (CUDA-aware): unchunked."""
    size = hvd.size()
    dev, on_device = _device_vs_host(placement, aware, BIG)
    log = dev.pipeline.log
    if on_device and size > 1 and not aware:
        assert sum(1 for e in log if e[0] == "wait") > 8 * 4, log   # >= 4 chunks each
        assert {e[0] for e in log} >= {"begin", "d2h", "h2d", "stream_wait", "finish"}
        assert [e[1] for e in dev.ops("d2h")], "all-to-all still staged in one piece"
    else:
        assert not log
    assert dev.pipeline.pending() == 0


def test_chunked_allreduce_overlaps_copies_with_host_calls(small_chunks, monkeypatch) -> None:
    """The order of the pipeline's operations on a staged all-reduce of 7 chunks: d2h of
    k+1 and h2d of k-1 issued around the host call on k, slots refilled after their h2d."""
    rank, size = hvd.rank(), hvd.size()
    dev = SimulatedDevice()
    log = dev.pipeline.log
    real = collectives.allreduce

    def logged(*args, **kwargs):
        log.append(("host", "", sum(1 for e in log if e[0] == "host")))
        return real(*args, **kwargs)

    monkeypatch.setattr(collectives, "allreduce", logged)
    with device.registered(dev):
        x = dev.tensor(data(rank, (100,), torch.float32))
        y = hvd.allreduce(x, op=hvd.Sum, name="dev.overlap")
    want = sum(data(q, (100,), torch.float32) for q in range(size))
    assert torch.equal(y.as_subclass(torch.Tensor), want) and dev.claims(y)
    if size > 1:
        _GPU_HELPERS.assert_overlap(log, staging.NSLOTS)


def test_chunking_follows_each_requests_metadata_not_the_first_of_its_size(
        small_chunks, monkeypatch) -> None:
    """A size first reduced on the host by every rank, then staged by the last rank only:
    the staged request runs in chunks on every rank (each rank learns from the negotiated
    ``Meta.stages``), with as many host calls everywhere; the same size on the host
    again: one call."""
    rank, size = hvd.rank(), hvd.size()
    shape = (100,)                                   # 400 bytes: chunks of 64
    want = sum(data(q, shape, torch.float32) for q in range(size))
    calls = []
    real = collectives.allreduce

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(collectives, "allreduce", counted)
    dev = SimulatedDevice()
    counts = []
    for i, staged in enumerate((False, True, False)):
        calls.clear()
        with device.registered(dev):
            x = data(rank, shape, torch.float32)
            if staged and rank == size - 1:
                x = dev.tensor(x)
            y = hvd.allreduce(x, op=hvd.Sum, name=f"dev.meta.{i}")
        assert torch.equal(y.as_subclass(torch.Tensor), want)
        counts.append(len(calls))
    everyone = MPI.COMM_WORLD.allgather(counts)
    if size > 1:
        assert all(c == everyone[0] for c in everyone), everyone
        assert counts[0] == counts[2] == 1 and counts[1] > 1, counts


class _Net(torch.nn.Module):
    """Two float64 layers and a float32 parameter: two flat gradient buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(8, 6, dtype=torch.float64)
        self.l2 = torch.nn.Linear(6, 3, dtype=torch.float64)
        self.extra = torch.nn.Parameter(torch.zeros(5))
        with torch.no_grad():                        # small integers: exact sums
            for i, p in enumerate(self.parameters()):
                p.copy_(data(0, p.shape, p.dtype, i))

    def forward(self, x: torch.Tensor, xd: torch.Tensor) -> torch.Tensor:
        return self.l2(self.l1(x)).sum() + (self.extra * xd).sum()


def _train(dev, steps: int) -> tuple[list, Any]:
    """``steps`` SGD steps of :class:`_Net` (on ``dev``, or the host), summed gradients."""
    rank = hvd.rank()
    net = _Net()
    if dev is not None:
        for module in net.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                setattr(module, name, torch.nn.Parameter(dev.tensor(p.detach())))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=2.0 ** -6),
                                   named_parameters=net.named_parameters(), op=hvd.Sum)
    for step in range(steps):
        opt.zero_grad()
        x = data(rank, (4, 8), torch.float64, step)
        xd = data(rank, (5,), torch.float32, step)
        if dev is not None:
            x, xd = dev.tensor(x), dev.tensor(xd)
        net(x, xd).backward()
        opt.step()
    return [p.detach() for p in net.parameters()], opt


def test_distributed_optimizer_on_the_device_keeps_flat_device_buffers(mode: str,
                                                                       small_chunks) -> None:
    """Device parameters get one flat gradient buffer per dtype on the device; bulk mode
    submits one device request per buffer and step (not one per parameter), staged in
    chunks; the parameters equal the host model's bit for bit in every mode. (Per
    tensor, the simulation cannot show device requests: inside autograd's hooks torch
    drops the tensor subclass on ``detach()``, so they run as host requests.)"""
    size, steps = hvd.size(), 3
    dev = SimulatedDevice()
    with device.registered(dev):
        got, opt = _train(dev, steps)
        assert [dev.claims(f.buffer) for f in opt._flat] == [True, True]
        assert all(dev.claims(p.grad) for p in opt._params)
    want, _ = _train(None, steps)
    for g, w in zip(got, want):
        assert torch.equal(g.as_subclass(torch.Tensor), w)
    if mode == "bulk":
        assert len(dev.ops("record")) == steps * 2, dev.log
        if size > 1:                                 # 75 float64 in 64-byte chunks
            assert sum(1 for e in dev.pipeline.log if e[0] == "wait") >= steps * 10
