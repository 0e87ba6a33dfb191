"""Duplicates made while a member dies (run by test_runtime_world.py under ``mpirun
--with-ft ulfm -n 3``, not by pytest).

Every rank duplicates ``MPI.COMM_WORLD`` through the runtime (``comms.dup``, then
``comms.free``) in a loop for at most :data:`LOOP_S` seconds; rank 1 SIGKILLs itself
:data:`KILL_S` seconds in. Open MPI 5.0.11's ``MPI_Comm_dup`` crashed the survivors there
in 8 of 14 jobs; under ULFM the runtime duplicates with ``MPI_Comm_split``, which raises.
Output: ``ORDER <rank> <1 if the duplicate's group is MPI_IDENT to the world's>`` (from
the first duplicate), then ``RESULT <rank> ...`` (fault_report.py).
"""
from __future__ import annotations

import os
import signal
import threading
import time

from mpi4py import MPI

import mpicoll
from fault_report import report
from mpicoll.runtime import comms

VICTIM = 1
KILL_S = 0.5
LOOP_S = 5.0


def main() -> None:
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    first = comms.dup(world, "test")
    same = MPI.Group.Compare(first.Get_group(), world.Get_group()) == MPI.IDENT
    print(f"ORDER {rank} {int(same)} {int(comms.dup_by_split)}", flush=True)
    comms.free(first)
    world.Barrier()
    if rank == VICTIM:
        def die() -> None:
            print(f"KILL {time.time():.6f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(KILL_S, die).start()
    start = time.time()
    try:
        while time.time() < start + LOOP_S:
            comms.free(comms.dup(world, "test"))
        report(rank)
    except Exception as exc:  # noqa: BLE001
        report(rank, exc, (mpicoll.ProcessFailedError,))


if __name__ == "__main__":
    main()
