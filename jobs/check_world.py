"""Fail unless the MPI world is the one Slurm allocated (run by every job before its work).

A launcher that does not speak the MPI library's process-management interface (for
example ``srun --mpi=pmix`` with the MPICH wheel, or ``srun`` without ``--mpi`` on a site
whose default is wrong) does not fail: it starts N independent singletons, each with a
world of size 1, and a training job would silently train N separate models. This check
catches that in a second.

Usage (inside a job): ``srun --mpi=pmi2 python -m mpi4py jobs/check_world.py [--expect N]``.
Prints, on rank 0: ``world ok: size N == expected N, M node(s), ranks per node [...]``.
Exits 1 on every rank otherwise.
"""
from __future__ import annotations

import argparse
import os
import sys

from mpi4py import MPI


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--expect", type=int, default=None,
                        help="expected world size (default: SLURM_NTASKS)")
    args = parser.parse_args()
    expect = args.expect if args.expect is not None else int(os.environ.get("SLURM_NTASKS", "0"))
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size != expect:
        procid = os.environ.get("SLURM_PROCID", "?")
        print(f"world WRONG: task {procid} sees MPI world size {size}, expected {expect} "
              "(the launcher's PMI does not match the MPI library: with the MPICH wheel use "
              "`srun --mpi=pmi2` or mpirun)", file=sys.stderr, flush=True)
        return 1
    hosts = comm.gather(MPI.Get_processor_name(), root=0)
    if rank == 0:
        per_node: dict[str, int] = {}
        for h in hosts:
            per_node[h] = per_node.get(h, 0) + 1
        lib = MPI.Get_library_version().splitlines()[0].strip()
        print(f"world ok: size {size} == expected {expect}, {len(per_node)} node(s), "
              f"ranks per node {list(per_node.values())}, {lib}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
