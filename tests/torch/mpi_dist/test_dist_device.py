"""Device tensors on the "mpicoll" backend, on the CPU: a simulated device
(:class:`doubles.torch_device.SimulatedDevice`) whose tensors the backend stages through
host memory on the group's thread. Work queued on the caller's stream before the call
runs only when the backend waits for the call's event, so a backend that read the
tensor without waiting would reduce stale data; results stay device tensors.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from doubles.torch_device import SimulatedDevice
from mpicoll.torch.device import tensors as device
from test_dist_collectives import GATHER_INTO, SCATTER_FROM, data, everyone
from test_dist_ops import cell

pytestmark = pytest.mark.mpi


@pytest.fixture
def sim():
    dev = SimulatedDevice(0)
    with device.registered(dev):
        yield dev


def late(sim: SimulatedDevice, tensor: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``tensor`` (a device tensor) gets ``value`` only through the caller's stream."""
    sim.on_caller_stream(lambda: tensor.copy_(value))
    return tensor


def test_device_collectives(sim):
    rank, n = dist.get_rank(), dist.get_world_size()
    for rep in range(2):
        a = late(sim, sim.tensor(torch.zeros(7, dtype=torch.int64)), data(rank, 7, rep))
        work = dist.all_reduce(a, async_op=True)
        b = late(sim, sim.tensor(torch.zeros(5, dtype=torch.int64)), data(rank, 5, rep))
        dist.broadcast(b, src=n - 1)
        gathered = sim.tensor(torch.full((3 * n,), -1, dtype=torch.int64))
        small = sim.tensor(torch.zeros(3, dtype=torch.int64))
        GATHER_INTO(gathered, late(sim, small, data(rank, 3, rep)))
        scattered = sim.tensor(torch.full((2,), -1, dtype=torch.int64))
        SCATTER_FROM(scattered, sim.tensor(data(rank, 2 * n, rep)))
        exchanged = sim.tensor(torch.full((2 * n,), -1, dtype=torch.int64))
        dist.all_to_all_single(exchanged, sim.tensor(torch.cat([cell(rank, d, 2, rep)
                                                                for d in range(n)])))
        work.wait()
        for t in (a, b, gathered, scattered, exchanged):
            assert sim.claims(t)
        assert torch.equal(sim.host(a), sum(everyone(7, rep)))
        assert torch.equal(sim.host(b), data(n - 1, 5, rep))
        assert torch.equal(sim.host(gathered), torch.cat(everyone(3, rep)))
        assert torch.equal(sim.host(scattered), sum(everyone(2 * n, rep))[2 * rank:2 * rank + 2])
        assert torch.equal(sim.host(exchanged), torch.cat([cell(s, rank, 2, rep)
                                                           for s in range(n)]))
    assert sim.pending() == 0
    kinds = [entry[0] for entry in sim.log]
    assert {"record", "wait", "d2h", "h2d", "sync"} <= set(kinds)
    assert kinds.index("wait") < kinds.index("d2h") < kinds.index("h2d")
