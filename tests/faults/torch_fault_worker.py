"""One torch-engine fault case under ``mpirun --with-ft ulfm`` (run by
test_torch_faults.py, not by pytest).

Usage: ``python torch_fault_worker.py OP VICTIM``: every rank runs ``mpicoll.torch``'s
``OP`` in a loop; rank ``VICTIM`` SIGKILLs itself after a few (``*-midway`` ops: from a
timer thread, while large tensors are in flight, so the death lands inside the data
path rather than in a negotiation round). Output lines as ulfm_worker.py's: ``KILL
<time>``; ``RESULT <rank> pfe <failed ranks> <time>`` from a survivor whose error is both
a :class:`mpicoll.ProcessFailedError` and ``hvd.HorovodInternalError``; ``RESULT <rank>
other ...`` otherwise. Survivors then keep the process alive a little (the stall
inspector's thread polls the revoked communicators), shrink the world
(:func:`mpicoll.elastic.shrink_world`), start ``hvd`` again on it and run a plain and a
codec-compressed all-reduce there (the codec's communicator comes from the new world, not
the revoked ``COMM_WORLD``): ``AFTER <rank> <size> <plain sum> <int8 sum>``; then they exit
normally (the exit handlers must not hang on the dead rank): ``EXITING <rank>``.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch

import mpicoll
import mpicoll.torch as hvd
from fault_report import report
from mpicoll.elastic import shrink_world

CALLS_BEFORE_KILL = 5
LOOP_S = 10.0


def make_call(op: str, rank: int):
    big = op.endswith("-midway")
    n = 1 << 21 if big else 1000
    t = torch.arange(n, dtype=torch.float32) + rank
    if op.startswith("allreduce"):
        return lambda: hvd.allreduce(t, name="ar")
    if op == "allgather":
        return lambda: hvd.allgather(t.reshape(-1, 10), name="ag")
    if op == "broadcast":
        return lambda: hvd.broadcast(t, root_rank=0, name="bc")
    if op == "alltoall":
        rows = torch.arange(hvd.size() * 100, dtype=torch.float32) + rank  # even splits
        return lambda: hvd.alltoall(rows, name="a2a")
    if op == "grouped_allreduce":
        return lambda: hvd.grouped_allreduce([t, t * 2, t[:7]], name="gar")
    if op == "optimizer":
        model = torch.nn.Linear(100, 10)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters())
        x = torch.randn(8, 100)

        def step() -> None:
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        return step
    raise SystemExit(f"unknown op {op!r}")


def main() -> None:
    op, victim = sys.argv[1], int(sys.argv[2])
    hvd.init()
    rank = hvd.rank()
    call = make_call(op, rank)
    start = time.time()
    try:
        for i in range(1 << 30):
            if rank == victim and i == CALLS_BEFORE_KILL:
                if op.endswith("-midway"):
                    def die() -> None:
                        print(f"KILL {time.time():.6f}", flush=True)
                        os.kill(os.getpid(), signal.SIGKILL)
                    threading.Timer(0.05, die).start()
                else:
                    print(f"KILL {time.time():.6f}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
            call()
            if i > CALLS_BEFORE_KILL and time.time() > start + LOOP_S:
                break
        report(rank)
    except Exception as exc:  # noqa: BLE001
        report(rank, exc, (mpicoll.ProcessFailedError, hvd.HorovodInternalError))
    time.sleep(0.5)   # the stall inspector polls the revoked communicators meanwhile
    shrink_world()
    hvd.init()        # the engine of the failed world is abandoned, a new one starts
    ones = torch.ones(300)
    plain = hvd.allreduce(ones, op=hvd.Sum, name="after").max().item()
    coded = hvd.allreduce(ones, op=hvd.Sum, name="after.int8",
                          compression=hvd.Compression.int8).max().item()
    print(f"AFTER {rank} {hvd.size()} {plain:g} {coded:.3f}", flush=True)
    hvd.shutdown()
    print(f"EXITING {rank}", flush=True)


if __name__ == "__main__":
    main()
