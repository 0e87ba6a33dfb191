"""Every client of the runtime on one world, a rank killed, the world shrunk (run by
test_runtime_world.py under ``mpirun --with-ft ulfm -n 3``, not by pytest).

Every rank uses each client of :mod:`mpicoll.runtime` once: the synchronous collectives
(a context with its node layout), hvd (the engine), a ``DistributedOptimizer`` with local
SGD (its averager) and with a codec compressor, the torch.distributed backend (the default
group and a subgroup), and a parameter server. Then rank 2 SIGKILLs itself; the survivors
see :class:`mpicoll.ProcessFailedError` and shrink the world. Output lines:

- ``OWNERS <rank> <owner,...>``: the owners of the runtime's communicators of world 0;
- ``PFE <rank> <failed ranks>``: the failure, seen by a survivor;
- ``OLD <rank> <alive> <unrevoked> <kept>``: after the shrink, how many communicators of
  world 0 are still alive in the registry, how many of those alive at the failure were
  not revoked, and how many made there were neither freed nor forgotten (all 0);
- ``NEW <rank> <size> <sum>``: an all-reduce and an hvd all-reduce on the new world;
- ``ALIVE <rank> <owner,...>``: at exit, after the runtime's own exit handlers, the owners
  of the communicators still alive (must be empty).
"""
from __future__ import annotations

import atexit
import os
import signal
import sys

RANK = os.environ.get("OMPI_COMM_WORLD_RANK", "?")


def _alive_at_exit() -> None:
    comms = sys.modules.get("mpicoll.runtime.comms")
    owners = sorted({r.owner for r in comms.alive()}) if comms is not None else ["?"]
    print(f"ALIVE {RANK} {','.join(owners) or '-'}", flush=True)


atexit.register(_alive_at_exit)   # before mpicoll: runs after the runtime's exit handlers

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import mpicoll  # noqa: E402
import mpicoll.torch as hvd  # noqa: E402
from mpicoll import ProcessFailedError  # noqa: E402
from mpicoll.elastic import shrink_world  # noqa: E402
from mpicoll.ps import ParameterServer  # noqa: E402
from mpicoll.runtime import comms  # noqa: E402

VICTIM = 2


def train(compression: object, sync_every: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=compression, sync_every=sync_every)
    for step in range(2):
        opt.zero_grad()
        model(torch.full((3, 4), float(hvd.rank() + step))).sum().backward()
        opt.step()


def use_every_client() -> None:
    rank = hvd.rank()
    x = np.arange(7, dtype=np.float64) * (rank + 1)
    assert np.allclose(mpicoll.allreduce(x), np.arange(7) * 6.0)
    assert hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum).item() == 3.0
    train(hvd.Compression.none, sync_every=2)          # local SGD: the averager
    train(hvd.Compression.int8, sync_every=1)          # a codec
    dist.init_process_group("mpicoll")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == 6.0
    sub = dist.new_group([0, 1])
    if rank < 2:
        s = torch.ones(1)
        dist.all_reduce(s, group=sub)
        assert s.item() == 2.0
    ps = ParameterServer({"w": np.zeros(5, dtype=np.float32)}, num_servers=1)
    if ps.is_server:
        ps.serve()
    else:
        ps.push_pull({"w": np.full(5, float(rank), dtype=np.float32)})
        ps.close()


def main() -> None:
    hvd.init()
    rank = hvd.rank()
    use_every_client()
    owners = sorted({r.owner for r in comms.of_world(0)})
    print(f"OWNERS {rank} {','.join(owners)}", flush=True)
    made = [r for r, what in comms.history if what == "made" and r.world == 0]
    mpicoll.allreduce(np.zeros(1))
    if rank == VICTIM:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        for _ in range(200):
            hvd.allreduce(torch.ones(1), op=hvd.Sum)
        raise SystemExit(f"rank {rank}: no failure seen")
    except ProcessFailedError as exc:
        print(f"PFE {rank} {','.join(map(str, exc.failed_ranks))}", flush=True)
    at_failure = comms.of_world(0)
    hvd.shutdown()
    shrink_world()
    ended = {id(r) for r, what in comms.history if what in ("freed", "forgotten")}
    alive_old = len(comms.of_world(0))   # owners named after the counts
    unrevoked = sum(1 for r in at_failure if not r.revoked)
    kept = sum(1 for r in made if id(r) not in ended)
    print(f"OLD {rank} {alive_old} {unrevoked} {kept} "
          f"{','.join(sorted({r.owner for r in comms.of_world(0)})) or '-'}", flush=True)
    hvd.init()
    total = mpicoll.allreduce(np.ones(3))[0] + hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
    print(f"NEW {rank} {hvd.size()} {total:g}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
