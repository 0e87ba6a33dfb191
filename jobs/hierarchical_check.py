"""Run the node-aware (hierarchical) all-reduce and show the node layout it used.

Prints, on rank 0, the layout (nodes, ranks per node, the leader of each node, whether the
nodes are real or emulated with ``MPICOLL_RANKS_PER_NODE``), then for each count checks
``algorithm="hierarchical"`` and ``algorithm="auto"`` (which ``MPICOLL_ALGORITHM=hierarchical``
forces to the same path) bit for bit against native MPI on rank-dependent integer-valued
data, twice on the same buffers, and times both against native. Exits 1 on every rank if
any result is wrong.

Usage (inside a job): ``srun --mpi=pmi2 python -m mpi4py jobs/hierarchical_check.py``.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from mpi4py import MPI

import mpicoll
from mpicoll.context import get_context


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="0,1,7,1000,262147",
                        help="comma-separated float32 element counts")
    parser.add_argument("--iters", type=int, default=5, help="timed repetitions per count")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    topo = get_context(comm).topology
    leaders = comm.gather(rank if topo.local_rank == 0 else None, root=0)
    if rank == 0:
        kind = "emulated (MPICOLL_RANKS_PER_NODE)" if topo.emulated else "real (shared memory)"
        print(f"topology: {topo.num_nodes} node(s) {kind}, ranks per node {topo.node_sizes}, "
              f"leaders {[r for r in leaders if r is not None]}", flush=True)
    ok = True
    for count in (int(c) for c in args.counts.split(",")):
        # small integers in float32: exact in any summation order
        x = ((np.arange(count) * 7 + rank * 13) % 251).astype(np.float32)
        ref = np.empty_like(x)
        comm.Allreduce(x, ref, op=MPI.SUM)
        times: dict[str, float] = {}
        for algo in ("native", "hierarchical", "auto"):
            out = np.empty_like(x)
            for rep in range(2):  # twice on the same buffers: stale plans show up
                out.fill(-1)
                mpicoll.allreduce(x, out, algorithm=algo)
                if not np.array_equal(out, ref):
                    print(f"WRONG: {algo} allreduce of {count} on rank {rank} (rep {rep})",
                          file=sys.stderr, flush=True)
                    ok = False
            best = float("inf")
            for _ in range(args.iters):
                comm.Barrier()
                t0 = time.perf_counter()
                mpicoll.allreduce(x, out, algorithm=algo)
                best = min(best, comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
            times[algo] = best
        if rank == 0:
            print(f"count {count:>9}: hierarchical {times['hierarchical'] * 1e6:10.1f} us  "
                  f"auto {times['auto'] * 1e6:10.1f} us  native {times['native'] * 1e6:10.1f} us",
                  flush=True)
    ok = comm.allreduce(ok, op=MPI.LAND)
    if rank == 0:
        print("hierarchical allreduce: all results correct" if ok else
              "hierarchical allreduce: WRONG results", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
