"""Demo: every all-reduce algorithm on rank-dependent data, checked and timed against native.

Run: ``mpirun -n 4 python -m mpi4py examples/allreduce_demo.py [--count N]``.
Prints, on rank 0, each algorithm's result check and its median time next to native MPI's
(interleaved, same run).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import mpicoll


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1 << 20, help="float32 elements")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    if args.count < 1 or args.iters < 1:
        parser.error("--count and --iters must be at least 1")
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    x = (np.arange(args.count) % 97 + rank).astype(np.float32)
    expected = (np.arange(args.count) % 97 * size + size * (size - 1) / 2).astype(np.float32)
    out = np.empty_like(x)
    algos = mpicoll.algorithms("allreduce")
    times: dict[str, list[float]] = {a: [] for a in algos}
    for it in range(args.iters + 2):
        for algo in algos:  # interleaved: drift on a noisy machine hits every algorithm alike
            comm.Barrier()
            t0 = time.perf_counter()
            mpicoll.allreduce(x, out, algorithm=algo)
            dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if it >= 2:
                times[algo].append(dt)
            if it == 0 and not np.array_equal(out, expected):
                raise SystemExit(f"{algo}: wrong result on rank {rank}")
    if rank == 0:
        native = float(np.median(times["native"]))
        level = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                 MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
        print(f"# mpicoll allreduce demo: {size} ranks, {args.count} float32 "
              f"({x.nbytes / 2**20:.1f} MiB), thread level {level[MPI.Query_thread()]}")
        print(f"# {MPI.Get_library_version().splitlines()[0]}")
        print(f"{'algorithm':<20}{'median ms':>12}{'x native':>10}  result")
        for algo in algos:
            med = float(np.median(times[algo]))
            print(f"{algo:<20}{med * 1e3:>12.3f}{med / native:>10.2f}  ok")


if __name__ == "__main__":
    main()
