"""What checked mode costs per call: all-reduce with and without the agreement step.

Run: ``mpirun -n N python -m mpi4py bench/checked_overhead.py``. Interleaves unchecked and
checked calls (same buffers, same algorithm) and prints medians and the added microseconds
per call, for a few sizes, on rank 0.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import mpicoll


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--sizes", default="8,65536,1048576", help="bytes (float32)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    if comm.rank == 0:
        print(f"# checked-mode overhead, {comm.size} ranks, thread level "
              f"{MPI.Query_thread()} (3 = multiple), {MPI.Get_library_version().splitlines()[0]}")
        print(f"{'bytes':>10}{'unchecked us':>14}{'checked us':>12}{'added us':>10}{'ratio':>8}")
    for nbytes in (int(s) for s in args.sizes.split(",")):
        x = np.ones(max(1, nbytes // 4), dtype=np.float32)
        y = np.empty_like(x)
        iters = max(20, min(args.iters, args.iters * 4096 // max(nbytes, 4096)))
        samples = {False: [], True: []}
        for i in range(iters + 10):
            for check in (False, True):
                comm.Barrier()
                t0 = time.perf_counter()
                mpicoll.allreduce(x, y, check=check)
                dt = time.perf_counter() - t0
                if i >= 10:
                    samples[check].append(dt)
        med = {k: comm.allreduce(float(np.median(v)), op=MPI.MAX) for k, v in samples.items()}
        if comm.rank == 0:
            print(f"{nbytes:>10}{med[False] * 1e6:>14.2f}{med[True] * 1e6:>12.2f}"
                  f"{(med[True] - med[False]) * 1e6:>10.2f}{med[True] / med[False]:>8.2f}")


if __name__ == "__main__":
    main()
