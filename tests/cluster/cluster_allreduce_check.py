"""Every all-reduce algorithm across the nodes of the namespace cluster, checked exactly.

Run under ``cluster/cluster mpirun`` (``tests/cluster/test_cluster_smoke.py`` does). Rank 0
prints the node layout mpicoll sees (``layout: nodes [2, 2] hosts [...]``), one line per
algorithm, and ``cluster allreduce: all results correct`` when every rank agrees; the exit
status is 1 on every rank otherwise (a verdict reduced over all ranks, so none hangs).

Data depends on rank, element index and repetition; the reference is computed on every rank
with numpy from the same formula (independent of MPI) and native MPI is checked against it
too. Each algorithm runs twice on the same buffers.

Usage: ``cluster/cluster mpirun -n 4 python tests/cluster/cluster_allreduce_check.py
[--counts 0,1,7,...] [--expect-nodes 2,2]``
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback

import numpy as np
from mpi4py import MPI

import mpicoll
from mpicoll.context import get_context
from mpicoll.selection import choose

COUNTS = "0,1,2,3,4,5,7,1001,65537,262147"


def data(rank: int, count: int, rep: int, dtype: np.dtype) -> np.ndarray:
    """This rank's input: small integers (exact in float32 in any summation order)."""
    i = np.arange(count, dtype=np.int64)
    return ((i * 7 + rank * 13 + rep * 5 + (i * rank) % 11) % 251 - 100).astype(dtype)


def check(comm: MPI.Comm, algos: list[str], counts: list[int]) -> list[str]:
    """Run every (algorithm, dtype, op, count) twice; return this rank's failures."""
    rank, size = comm.Get_rank(), comm.Get_size()
    failures = []
    cases = [(np.dtype(np.int64), "sum"), (np.dtype(np.float32), "sum"),
             (np.dtype(np.int64), "max")]
    for algo in algos:
        for dtype, op in cases:
            for count in counts:
                out = np.empty(count, dtype)
                for rep in range(2):
                    x = data(rank, count, rep, dtype)
                    every = np.stack([data(r, count, rep, dtype) for r in range(size)]) \
                        if count else np.zeros((size, 0), dtype)
                    ref = every.sum(axis=0, dtype=dtype) if op == "sum" else every.max(axis=0)
                    out.fill(-7)
                    if algo == "mpi":
                        comm.Allreduce(x, out, op=MPI.SUM if op == "sum" else MPI.MAX)
                    else:
                        mpicoll.allreduce(x, out, op=op, comm=comm, algorithm=algo)
                    if not np.array_equal(out, ref):
                        bad = int(np.flatnonzero(out != ref)[0])
                        failures.append(f"{algo} {op} {dtype} count {count} rep {rep} rank "
                                        f"{rank}: element {bad} is {out[bad]}, expected "
                                        f"{ref[bad]}")
        comm.Barrier()
        if rank == 0:
            print(f"checked {algo}", flush=True)
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default=COUNTS, help=f"element counts [{COUNTS}]")
    parser.add_argument("--algos", default="",
                        help="comma-separated algorithms [mpi, every registered one, auto]")
    parser.add_argument("--linger", type=float, default=0.0, metavar="SECONDS",
                        help="rank 0 waits this long before it ends (the others have "
                             "finalized by then)")
    parser.add_argument("--expect-nodes", default="",
                        help="fail unless the node sizes are these (e.g. 2,2)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    failures: list[str] = []
    try:
        topo = get_context(comm).topology
        hosts = comm.allgather(MPI.Get_processor_name())
        if rank == 0:
            print(f"layout: nodes {topo.node_sizes} emulated {topo.emulated} hosts {hosts}",
                  flush=True)
            ctx = get_context(comm)
            picks = {f"{b >> 10}K": choose("allreduce", comm.Get_size(), ctx.ranks_per_node, b)
                     for b in (4 << 10, 16 << 20)}
            print(f"auto picks: {picks}", flush=True)
        if args.expect_nodes:
            want = [int(s) for s in args.expect_nodes.split(",")]
            if topo.node_sizes != want or topo.emulated:
                failures.append(f"rank {rank}: layout {topo!r}, expected nodes {want}")
            # ranks of one node share a hostname, different nodes do not
            mine = {h for h, n in zip(hosts, comm.allgather(topo.node_index))
                    if n == topo.node_index}
            if len(mine) != 1 or len(set(hosts)) != topo.num_nodes:
                failures.append(f"rank {rank}: hostnames {hosts} do not match the layout")
        algos = (args.algos.split(",") if args.algos else
                 ["mpi", *mpicoll.algorithms("allreduce"), "auto"])
        failures += check(comm, algos, [int(c) for c in args.counts.split(",")])
    except Exception:  # noqa: BLE001 - reported, and every rank learns the verdict
        failures.append(f"rank {rank}: {traceback.format_exc()}")
    for line in failures[:5]:
        print(f"WRONG: {line}", file=sys.stderr, flush=True)
    ok = comm.allreduce(not failures, op=MPI.LAND)
    if rank == 0:
        print("cluster allreduce: all results correct" if ok else
              "cluster allreduce: WRONG results", flush=True)
    if rank == 0 and args.linger:
        time.sleep(args.linger)
    # mpicoll's state (the shm window, the stall inspector's communicators) is freed by its
    # own exit handler before MPI_Finalize
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
