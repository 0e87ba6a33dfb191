"""What a commit costs with a discovery active (one 16-byte broadcast from rank 0 per
commit) against without (a local copy): run under mpirun, not by pytest; the numbers go
to docs/results/elastic_grow.md.

Usage: ``mpirun -n N python tests/faults/elastic_grow_cost.py [COMMITS] [ROUNDS]``. Each
round times ``COMMITS`` commits of a small ``ObjectState`` (an int and 1000 doubles)
inside ``mpicoll.elastic.run``, once without a discovery and once with one (a callable
reporting as many slots as ranks: nothing to do), alternating; rank 0 prints the median
per-commit time of each and their difference.
"""
from __future__ import annotations

import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

import mpicoll.elastic as elastic


def timed(discovery: object, commits: int) -> float:
    """Seconds per commit, the slowest rank's."""
    state = elastic.ObjectState(step=0, w=np.zeros(1000))
    size = MPI.COMM_WORLD.Get_size()

    @elastic.run(discovery=discovery, max_np=size, discovery_interval=1.0)
    def loop(state: elastic.ObjectState) -> float:
        elastic.world().Barrier()
        start = time.perf_counter()
        for _ in range(commits):
            state.step += 1
            state.commit()
        return time.perf_counter() - start

    took = loop(state)
    return MPI.COMM_WORLD.allreduce(took, op=MPI.MAX) / commits


def main() -> None:
    commits = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    size = MPI.COMM_WORLD.Get_size()
    plain, checked = [], []
    for _ in range(rounds):
        plain.append(timed(None, commits))
        checked.append(timed(lambda: size, commits))
    if MPI.COMM_WORLD.Get_rank() == 0:
        p, c = statistics.median(plain), statistics.median(checked)
        print(f"n={size} commits={commits} rounds={rounds} "
              f"library={MPI.Get_library_version().splitlines()[0][:40]!r}")
        print(f"commit without discovery: {p * 1e6:.1f} us; with: {c * 1e6:.1f} us; "
              f"the check: {(c - p) * 1e6:.1f} us per commit")


if __name__ == "__main__":
    main()
