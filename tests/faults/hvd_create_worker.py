"""mpicoll.torch's communicators made while a member dies (run by test_torch_faults.py
under ``mpirun --with-ft ulfm -n 4``, not by pytest).

Usage: ``python hvd_create_worker.py WHEN``. Ranks 0-2 start ``mpicoll.torch`` on a
communicator of their own (``hvd.init(comm=...)``: the engine's side communicator, which
compressed all-reduces and local SGD use, is then made by ``MPI_Comm_create_group``
over the world); rank 3 stays out. Rank 1 SIGKILLs itself, and at once ranks 0 and 2
ask for the side communicator: ``WHEN=race`` directly (the creation meets the death,
where Open MPI's ``MPI_Comm_create_group`` waits for the dead member forever);
``WHEN=optimizer`` by building a local-SGD ``DistributedOptimizer`` :data:`AFTER_S`
seconds later, once the engine has failed. ``WHEN=init``: rank 1 dies before
``hvd.init``, whose duplicate of the communicator then fails on the others. Output:
``KILL <time>``, ``RESULT <rank> ...`` (fault_report.py; ``pfe`` needs both
``ProcessFailedError`` and ``HorovodInternalError``), ``EXITING <rank>``.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import torch
from mpi4py import MPI

import mpicoll
import mpicoll.torch as hvd
from fault_report import report
from mpicoll.torch.state import engine

VICTIM = 1
#: How long ``WHEN=optimizer`` waits after the death (the engine notices it in 0.1-0.3 s).
AFTER_S = 0.8


def main() -> None:
    when = sys.argv[1]
    rank = MPI.COMM_WORLD.Get_rank()
    sub = MPI.COMM_WORLD.Split(0 if rank < 3 else 1, rank)
    if rank == 3:
        print("EXITING 3", flush=True)
        return
    model = torch.nn.Linear(10, 2)
    torch.optim.SGD(model.parameters(), lr=0.1)   # torch's first optimizer imports, ~1 s
    if when != "init":
        hvd.init(comm=sub)
    if rank == VICTIM:
        print(f"KILL {time.time():.6f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        if when == "init":
            hvd.init(comm=sub)
        elif when == "race":
            engine().side_comm()
        else:
            time.sleep(AFTER_S)
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(),
                                     sync_every=2)
        report(rank)
    except Exception as exc:  # noqa: BLE001
        report(rank, exc, (mpicoll.ProcessFailedError, hvd.HorovodInternalError))
    print(f"EXITING {rank}", flush=True)


if __name__ == "__main__":
    main()
