"""One fault case under ``mpirun --with-ft ulfm`` (run by test_ulfm.py, not by pytest).

Usage: ``python ulfm_worker.py CALL ALGORITHM VICTIM``: every rank runs ``CALL`` (a
collective name, ``Comm.<Method>``, ``allreduce_init`` or ``compressed.<collective>``) in a
loop; rank ``VICTIM`` kills itself (SIGKILL) after a few calls. Output lines:
``KILL <time>`` from the victim just before it dies; ``RESULT <rank> pfe <failed ranks>
<time>`` from a survivor that got :class:`mpicoll.ProcessFailedError`, ``RESULT <rank>
other <type> <time> <message>`` for any other exception, ``RESULT <rank> none`` if the
loop ran out. Survivors then shrink the world and meet, so none exits (and looks failed to
another survivor still collecting the failed ranks) before all have reported.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

import mpicoll
from fault_report import report

CALLS_BEFORE_KILL = 5
LOOP_S = 10.0


def make_call(name: str, algorithm: str, comm: MPI.Intracomm):
    n = comm.Get_size()
    x = np.arange(4096, dtype=np.float64)
    y = np.empty_like(x)
    shard = np.empty(4096 // n if 4096 % n == 0 else 1, np.float64)
    gathered = np.empty(4096 * n, np.float64)
    if name == "allreduce":
        return lambda: mpicoll.allreduce(x, y, comm=comm, algorithm=algorithm)
    if name == "reduce_scatter":
        xs = np.ones(64 * n, np.float64)
        out = np.empty(64, np.float64)
        return lambda: mpicoll.reduce_scatter(xs, out, comm=comm, algorithm=algorithm)
    if name == "allgather":
        return lambda: mpicoll.allgather(x, gathered, comm=comm, algorithm=algorithm)
    if name == "broadcast":
        return lambda: mpicoll.broadcast(x, 0, comm=comm, algorithm=algorithm)
    if name == "reduce":
        return lambda: mpicoll.reduce(x, y, root=0, comm=comm, algorithm=algorithm)
    if name == "allreduce_init":
        return mpicoll.allreduce_init(x, y, comm=comm, algorithm=algorithm)
    if name.startswith("Comm."):
        c = mpicoll.Comm(comm, algorithm=algorithm)
        method = name.split(".", 1)[1]
        if method == "Allreduce":
            return lambda: c.Allreduce(x, y)
        if method == "Allgather":
            return lambda: c.Allgather(x, gathered)
        if method == "Bcast":
            return lambda: c.Bcast(x, 0)
        if method == "Reduce":
            return lambda: c.Reduce(x, y, root=0)
        xs = np.ones(64 * n, np.float64)
        out = np.empty(64, np.float64)
        return lambda: c.Reduce_scatter_block(xs, out)
    if name.startswith("compressed."):
        from mpicoll import compression
        collective = name.split(".", 1)[1]
        if collective == "allreduce":
            return lambda: compression.allreduce(x, y, comm=comm, compression="fp16",
                                                 check=False)
        if collective == "allgather":
            return lambda: compression.allgather(x, gathered, comm=comm,
                                                 compression="fp16", check=False)
        xs = np.ones(64 * n, np.float64)
        out = np.empty(64, np.float64)
        return lambda: compression.reduce_scatter(xs, out, comm=comm, compression="fp16",
                                                  check=False)
    raise SystemExit(f"unknown call {name!r}")


def main() -> None:
    name, algorithm, victim = sys.argv[1], sys.argv[2], int(sys.argv[3])
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    call = make_call(name, algorithm, world)
    try:
        for i in range(1 << 30):
            if rank == victim and i == CALLS_BEFORE_KILL:
                print(f"KILL {time.time():.6f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            call()
            if i > CALLS_BEFORE_KILL and time.time() > start + LOOP_S:
                break
            if i == 0:
                start = time.time()
        report(rank)
    except Exception as exc:  # noqa: BLE001
        report(rank, exc)
    try:
        world.Shrink().Barrier()
    finally:
        os._exit(0)


if __name__ == "__main__":
    main()
