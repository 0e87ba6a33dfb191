"""A numpy training loop under ``mpicoll.elastic`` (run by test_elastic_numpy.py under
``mpirun --with-ft ulfm``, not by pytest).

Usage: ``python elastic_numpy_worker.py STEPS KILL_STEP VICTIMS MIN_NP [ALGORITHM]``
(``VICTIMS``: one rank, or several separated by commas, as the ranks of a node;
``ALGORITHM`` of the all-reduce, default ``ring``: ``shm`` and ``hierarchical`` rebuild
their node layout and shared-memory windows on the survivors' world). Every step
all-reduces (``comm=None``: the current world) a rank- and step-dependent vector and adds
it to the state, then commits; each rank of ``VICTIMS`` (of the original world) SIGKILLs itself at
step ``KILL_STEP`` (just before that step's collective). Output lines: ``KILL <time>``;
on every survivor at the end ``DONE <world rank> <size> <step> <total> <checksum>
<recoveries>``, where ``total`` sums each step's world size (an all-reduce of ones): with
a correct restore it is exactly ``KILL_STEP * n + (STEPS - KILL_STEP) * (n - len(VICTIMS))``;
``TOOFEW <world rank> <size> <min_np> <time>`` when fewer than ``MIN_NP`` survive.

``KILL_STEP`` -1: the victims die before the first sync (the state's broadcast meets the
failure), rank 1's first reset callback raises (its run ends with it; its exit then ends
it as a failed process),
and every step also sums over the world with mpi4py itself (``elastic.world().allreduce``).
"""
from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

import mpicoll
import mpicoll.elastic as elastic


def _raise_once() -> None:
    raise ValueError("a reset callback failed on rank 1")


def main() -> None:
    steps, kill_step, min_np = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[4])
    victims = {int(r) for r in sys.argv[3].split(",")}
    algorithm = sys.argv[5] if len(sys.argv) > 5 else "ring"
    me = MPI.COMM_WORLD.Get_rank()
    state = elastic.ObjectState(step=0, total=0, weights=np.zeros(1001, np.float64))
    resets: list[int] = []
    state.register_reset_callbacks([lambda: resets.append(elastic.world().Get_size())])
    if kill_step == -1:
        if me in victims:
            print(f"KILL {time.time():.6f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if me == 1:
            state.register_reset_callbacks([_raise_once])

    @elastic.run(min_np=min_np)
    def train(state: elastic.ObjectState) -> None:
        while state.step < steps:
            if me in victims and state.step == kill_step:
                print(f"KILL {time.time():.6f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            # this rank's contribution: depends on its original rank and the step
            grad = np.arange(1001, dtype=np.float64) * (me + 1) + state.step
            total = mpicoll.allreduce(grad, op="sum", algorithm=algorithm)
            size = int(mpicoll.allreduce(np.ones(1, np.int64), op="sum")[0])
            if kill_step == -1:
                assert elastic.world().allreduce(1) == size
            assert size == elastic.world().Get_size(), (size, elastic.world().Get_size())
            state.weights += total * 1e-3
            state.total += size
            state.step += 1
            state.commit()

    try:
        train(state)
    except elastic.TooFewRanksError as exc:
        print(f"TOOFEW {me} {exc.size} {exc.min_np} {time.time():.6f}", flush=True)
        # every survivor has printed before any exits: the first non-zero exit makes
        # mpirun kill the others (a survivor a moment behind lost its line once in CI)
        elastic.world().Barrier()
        sys.exit(3)
    checksum = float(np.sum(state.weights * np.arange(1, 1002)))
    rec = elastic.last_recovery()
    phases = "-" if rec is None else rec.summary()
    print(f"DONE {me} {elastic.world().Get_size()} {state.step} {state.total} "
          f"{checksum!r} {str(resets).replace(' ', '')} {phases}", flush=True)


if __name__ == "__main__":
    main()
