"""The node's barrier under late arrivals: the ``shm`` all-reduce on threads that wait as a
runtime lane does, each rank busy for ``rank * skew`` ms (in turn) before every call::

    MPICOLL_NODE_WAIT=kernel mpirun -n 4 python -m bench.node_wait --skew-ms 2
    MPICOLL_NODE_WAIT=mpi    mpirun -n 4 python -m bench.node_wait --skew-ms 2

Prints the time per call (the slowest rank's) and the CPU time per rank and call, the busy
part included (its average is printed beside it). Checks the result on every rank.
"""
from __future__ import annotations

import argparse
import threading
import time

import numpy as np
from mpi4py import MPI

import mpicoll
from mpicoll import waiting
from mpicoll.context import get_context
from mpicoll.node_window import node_window


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=400_000, help="float32 elements")
    parser.add_argument("--skew-ms", type=float, default=2.0)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--blocking", action="store_true",
                        help="threads that block in MPI (the caller's thread's way)")
    args = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    comm = world.Dup()
    x = (np.arange(args.count, dtype=np.float32) % 7) * (rank + 1)
    expected = (np.arange(args.count, dtype=np.float32) % 7) * (n * (n + 1) / 2)
    skew = args.skew_ms * 1e-3
    out = {}

    def busy(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    def run() -> None:
        waiting.set_sleeps(not args.blocking)
        y = np.empty_like(x)
        for _ in range(3):
            mpicoll.allreduce(x, y, comm=comm, algorithm="shm")
        comm.Barrier()
        start, cpu = time.perf_counter(), time.process_time()
        for i in range(args.iters):
            busy(skew * ((rank + i) % n))
            mpicoll.allreduce(x, y, comm=comm, algorithm="shm")
        out["wall"], out["cpu"] = time.perf_counter() - start, time.process_time() - cpu
        out["ok"] = bool(np.array_equal(y, expected))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    kernel = node_window(get_context(comm)).kernel
    results = world.gather(out)
    if rank == 0:
        busy_avg = sum(skew * ((r + i) % n) for r in range(n) for i in range(args.iters))
        print(f"n={n} count={args.count} skew={args.skew_ms} ms kernel_waits={kernel} "
              f"{'blocking' if args.blocking else 'polling'} threads: "
              f"{max(r['wall'] for r in results) / args.iters * 1e3:.2f} ms per call, "
              f"cpu {sum(r['cpu'] for r in results) / n / args.iters * 1e3:.2f} ms per rank "
              f"and call (busy {busy_avg / n / args.iters * 1e3:.2f}), "
              f"results {'right' if all(r['ok'] for r in results) else 'WRONG'}")
    comm.Free()
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
