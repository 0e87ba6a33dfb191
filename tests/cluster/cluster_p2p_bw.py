"""Time large point-to-point transfers between nodes and within a node of the namespace cluster.

Run with ranks on at least two nodes (``cluster/cluster mpirun -n 4 -ppn 2`` or ``srun -N 2
--ntasks-per-node 2 --mpi=pmi2``). Rank 0 sends ``--bytes`` to the first rank on another
node (``inter``) and, if there is one, to the first other rank on its own node (``intra``):
after a warm-up exchange (connection set-up), rank 0 sends, the receiver checks the data
and answers with one byte; the time is taken on rank 0 from the send to the answer,
``--reps`` times per pair, while the other ranks wait in a barrier. Rank 0 prints one line
per pair::

    p2p inter n1->n2: 16777216 B, best 0.1352 s, 124.1 MB/s

(best = the shortest time, i.e. the highest rate seen), then for every rank the MPICH
shared-memory segments it sees in ``/dev/shm`` (``shm rank 1 on n1: mpich_shm_5a1e_0``:
ranks of one node must see the same ones, ranks of different nodes none in common), and
every rank exits 1 if no rank is on another node or data arrived wrong. Whether the rates
fit the link is for the caller to judge (tests/cluster/test_cluster_slurm.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from mpi4py import MPI


def _transfer(comm: MPI.Intracomm, peer: int, n: int, reps: int) -> tuple[float, bool]:
    """Time ``reps`` sends of ``n`` int64 from rank 0 to ``peer``; (best seconds, data ok)."""
    rank = comm.Get_rank()
    ok, best = True, float("inf")
    if rank not in (0, peer):
        for _ in range(2 + reps):
            comm.Barrier()
        return best, ok
    expect = np.arange(n, dtype=np.int64) * 3 + 1
    data = expect.copy() if rank == 0 else np.empty(n, dtype=np.int64)
    ack = np.zeros(1, dtype=np.uint8)
    other = peer if rank == 0 else 0
    for rep in range(-2, reps):  # two untimed: connection set-up is not part of it
        comm.Barrier()
        if rank == 0:
            t0 = time.perf_counter()
            comm.Send(data, dest=other, tag=3)
            comm.Recv(ack, source=other, tag=4)
            if rep >= 0:
                best = min(best, time.perf_counter() - t0)
        else:
            data.fill(-1)
            comm.Recv(data, source=other, tag=3)
            comm.Send(ack, dest=other, tag=4)
            if not np.array_equal(data, expect):
                print(f"p2p: WRONG data from rank 0 in transfer {rep}", file=sys.stderr,
                      flush=True)
                ok = False
    return best, ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=16 << 20, help="message size in bytes")
    parser.add_argument("--reps", type=int, default=3, help="timed transfers per pair")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    hosts = comm.allgather(MPI.Get_processor_name())
    inter = next((r for r, h in enumerate(hosts) if h != hosts[0]), None)
    intra = next((r for r, h in enumerate(hosts) if r > 0 and h == hosts[0]), None)
    if inter is None:
        if rank == 0:
            print(f"p2p: no rank on another node than rank 0: {hosts}", file=sys.stderr,
                  flush=True)
        return 1
    n = args.bytes // 8
    ok = True
    for kind, peer in (("inter", inter), ("intra", intra)):
        if peer is None:
            continue
        best, fine = _transfer(comm, peer, n, args.reps)
        ok = ok and fine
        if rank == 0:
            print(f"p2p {kind} {hosts[0]}->{hosts[peer]}: {n * 8} B, best {best:.4f} s, "
                  f"{n * 8 / best / 1e6:.1f} MB/s", flush=True)
    segments = sorted(f for f in os.listdir("/dev/shm") if f.startswith("mpich_shm_"))
    seen = comm.gather(segments, root=0)
    if rank == 0:
        for r, names in enumerate(seen):
            print(f"shm rank {r} on {hosts[r]}: {' '.join(names)}", flush=True)
    ok = comm.allreduce(ok, op=MPI.LAND)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
