"""A rank whose elastic function ends early (run by test_elastic_end.py under ``mpirun
--with-ft ulfm``, not by pytest).

Usage: ``python elastic_end_worker.py MODE STEPS STOP_STEP``. Every step all-reduces ones
over the current world (``total`` adds the world size: with a correct restore it is exactly
``STOP_STEP * n + (STEPS - STOP_STEP) * survivors``), sleeps 10 ms and commits. Modes:

- ``return`` / ``exit``: the last rank's function returns (``sys.exit(0)``) just before
  step ``STOP_STEP``'s collective, while the others train on: it must leave as a lost
  rank, and the others finish at the smaller size;
- ``slow``: every rank trains to the end; then rank 0 alone works 3 s more inside the
  function (no collective): nobody leaves, every rank ends at full size;
- ``again``: the function runs once to step 2 (every rank ends it), then again, where the
  last rank ends early as in ``return``: each run of the function ends on its own;
- ``kill``: the same rank SIGKILLs itself instead (the recovery the end agreement must
  not slow down: measured, not a test case);
- ``hvd``: ``return`` through ``hvd.elastic`` (``TorchState``, ``DistributedOptimizer``): the
  others wait in the Horovod engine's negotiation, which the stall inspector does not see;
- ``fail``: at 4 ranks, ranks 2 and 3 end after the last step while ranks 0 and 1 run
  extra steps on a communicator of their own; rank 1 SIGKILLs itself at the second: rank
  0 resets, and so must the ranks that wait at the end (they learn it from the end
  agreement), and the 3 survivors run the function again from the last commit and end.

Output: ``EARLY <rank> <time>`` where a rank's function ends early; ``FIRST <time>`` on
each survivor at its first completed step after a reset; ``DONE <world rank> <size>
<step> <total> <result> <resets>`` on every rank that returns from ``run``.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

import mpicoll
import mpicoll.elastic as elastic


def torch_main(mode: str, steps: int, stop_step: int) -> None:
    """``hvd`` (Horovod's API) or ``ddp`` (DDP on the "mpicoll" process group)."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    import mpicoll.torch as hvd  # noqa: PLC0415
    torch.manual_seed(0)
    model = torch.nn.Linear(10, 1)
    if mode == "ddp":
        dist.init_process_group("mpicoll")
        me, n = dist.get_rank(), dist.get_world_size()
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    else:
        hvd.init()
        me, n = hvd.rank(), hvd.size()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters())

    def size() -> int:
        return dist.get_world_size() if mode == "ddp" else hvd.size()

    def count() -> int:
        ones = torch.ones(1)
        if mode == "ddp":
            dist.all_reduce(ones)
            return int(ones.item())
        return int(hvd.allreduce(ones, op=hvd.Sum).item())
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0, total=0)
    resets: list[int] = []
    first = [False]

    def on_reset() -> None:
        resets.append(size())
        first[0] = True

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> str:
        while state.step < steps:
            if me == n - 1 and state.step == stop_step:
                print(f"EARLY {me} {time.time():.6f}", flush=True)
                return "early"
            opt.zero_grad()
            model(torch.ones(4, 10) * (me + 1)).sum().backward()
            opt.step()
            state.total += count()
            if first[0]:
                first[0] = False
                print(f"FIRST {time.time():.6f}", flush=True)
            state.step += 1
            time.sleep(0.01)
            state.commit()
        return "done"

    result = train(state)
    print(f"DONE {me} {size()} {state.step} {state.total} {result} {resets}", flush=True)


def main() -> None:
    mode, steps, stop_step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if mode in ("hvd", "ddp"):
        torch_main(mode, steps, stop_step)
        return
    me, n = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    state = elastic.ObjectState(step=0, total=0)
    resets: list[int] = []
    first = [False]

    def on_reset() -> None:
        resets.append(elastic.world().Get_size())
        first[0] = True

    state.register_reset_callbacks([on_reset])

    limit = [2 if mode == "again" else steps]

    @elastic.run
    def train(state: elastic.ObjectState) -> str:
        while state.step < limit[0]:
            if mode in ("return", "exit", "kill", "again") and me == n - 1 and \
                    state.step == stop_step:
                print(f"EARLY {me} {time.time():.6f}", flush=True)
                if mode == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if mode == "exit":
                    sys.exit(0)
                return "early"
            size = int(mpicoll.allreduce(np.ones(1, np.int64), op="sum")[0])
            if first[0]:
                first[0] = False
                print(f"FIRST {time.time():.6f}", flush=True)
            state.total += size
            state.step += 1
            time.sleep(0.01)
            state.commit()
        if mode == "slow" and me == 0:
            time.sleep(3.0)
        world = elastic.world()
        if mode == "fail" and world.Get_size() == n:
            pair = world.Split(0 if me < 2 else MPI.UNDEFINED, me)
            if pair != MPI.COMM_NULL:
                for extra in range(4):
                    if me == 1 and extra == 2:
                        os.kill(os.getpid(), signal.SIGKILL)
                    mpicoll.allreduce(np.ones(3), comm=pair)
                    time.sleep(0.2)
        return "done"

    result = train(state)
    if mode == "again":
        limit[0] = steps
        result = train(state)
    print(f"DONE {me} {elastic.world().Get_size()} {state.step} {state.total} {result} "
          f"{resets}", flush=True)


if __name__ == "__main__":
    main()
