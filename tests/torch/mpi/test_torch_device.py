"""Device tensors through mpicoll.torch, on the CPU: a simulated device
(:class:`mpicoll.torch.simulated_device.SimulatedDevice`) whose tensors the engine stages
through (simulated) pinned host memory, or hands to the collective directly as CUDA-aware
MPI would. Every op equals the same op on host tensors bit for bit, results stay on the
device, and ranks that disagree (device here, host there) still agree on the data.

Each test runs all its collectives before its first assertion (a rank that failed early
would leave the others waiting).
"""
from __future__ import annotations

import pytest
import torch

import mpicoll.torch as hvd
from mpicoll.torch import device
from mpicoll.torch.simulated_device import SimulatedDevice

pytestmark = pytest.mark.mpi

#: Which ranks put their tensors on the device: all, or every other one (disagreement).
PLACEMENTS = ["all", "alternate"]


def data(rank: int, shape: tuple, dtype: torch.dtype, rep: int = 0) -> torch.Tensor:
    """Small integers depending on rank, element index and repetition (exact sums)."""
    n = 1
    for d in shape:
        n *= d
    idx = torch.arange(n, dtype=torch.int64)
    return ((idx * 3 + rank * 5 + rep * 7) % 11 - 5).to(dtype).view(shape)


def _ops(place, rank: int, size: int, rep: int) -> dict:
    """Every op, on tensors made by ``place`` (host or device); names fixed per rep."""
    out = {}
    a = place(data(rank, (5, 3), torch.float32, rep))
    b = place(data(rank, (7,), torch.float32, rep + 1))
    c = place(data(rank, (4,), torch.bfloat16, rep + 2))
    handles = [hvd.allreduce_async(a, name=f"dev.a.{rep}", op=hvd.Sum),
               hvd.allreduce_async(b, name=f"dev.b.{rep}", op=hvd.Average),
               hvd.allreduce_async(c, name=f"dev.c.{rep}", op=hvd.Sum)]
    out["allreduce"] = [hvd.synchronize(h) for h in handles]
    inplace = place(data(rank, (6,), torch.int32, rep))
    hvd.allreduce_(inplace, name=f"dev.inplace.{rep}", op=hvd.Sum)
    out["allreduce_"] = inplace
    out["grouped"] = hvd.grouped_allreduce([place(data(rank, (3,), torch.float64, rep)),
                                            place(data(rank, (2, 2), torch.float64, rep))],
                                           name=f"dev.group.{rep}", op=hvd.Sum)
    out["allgather"] = hvd.allgather(place(data(rank, (rank + 1, 2), torch.int64, rep)),
                                     name=f"dev.gather.{rep}")
    out["allgather_even"] = hvd.allgather(place(data(rank, (2, 3), torch.bfloat16, rep)),
                                          name=f"dev.gather_even.{rep}")
    bcast = place(data(rank, (3, 2), torch.float32, rep))
    hvd.broadcast_(bcast, root_rank=size - 1, name=f"dev.bcast.{rep}")
    out["broadcast_"] = bcast
    splits = [(rank + dst) % 2 + 1 for dst in range(size)]
    out["alltoall"] = hvd.alltoall(place(data(rank, (sum(splits), 2), torch.float32, rep)),
                                   splits=splits, name=f"dev.a2a.{rep}")
    out["reducescatter"] = hvd.reducescatter(place(data(rank, (size + 1, 2), torch.float32,
                                                        rep)),
                                             op=hvd.Sum, name=f"dev.rs.{rep}")
    return out


def _flatten(value) -> list:
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flatten(v)]
    return [value]


@pytest.mark.parametrize("aware", [False, True], ids=["staged", "aware"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_every_op_equals_the_host_reference(placement: str, aware: bool) -> None:
    rank, size = hvd.rank(), hvd.size()
    dev = SimulatedDevice(aware=aware)
    on_device = placement == "all" or rank % 2 == 0
    with device.simulated(dev):
        got = [_ops(dev.tensor if on_device else (lambda t: t), rank, size, rep)
               for rep in range(2)]                  # twice: reused buffers and views
    want = [_ops(lambda t: t, rank, size, rep) for rep in range(2)]   # same names reused
    for g, w in zip(got, want):
        for key in w:
            for x, y in zip(_flatten(g[key]), _flatten(w[key])):
                assert x.dtype == y.dtype and x.shape == y.shape, key
                assert torch.equal(x.as_subclass(torch.Tensor), y), key
            results = _flatten(g[key][0] if key == "alltoall" else g[key])  # not its splits
            assert all(dev.claims(x) == on_device for x in results), key
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
    with device.simulated(dev):
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
