"""A rank dies; the survivors, on both nodes, shrink and go on (Open MPI with ULFM).

Run under ``cluster/cluster ompirun --with-ft ulfm -n 4`` on 2 nodes x 2 ranks
(``tests/cluster/test_cluster_ompi.py`` does). A numpy program under
:func:`mpicoll.elastic.run`: every step all-reduces rank-dependent data over the world in
force and adds the sum to the state, then commits. Launch rank 3 (on the second node)
SIGKILLs itself before the all-reduce of step :data:`KILL_AT`; the survivors (ranks 0 and 1
on the first node, rank 2 on the second) must catch the failure, shrink to 3 ranks, redo
that step from the last commit and finish. Each survivor prints::

    RESULT <launch rank> <host> size <size> failed <ranks> ok|WRONG <total>

where ``ok`` means the total equals the one computed here from the history (4 ranks for
steps 0 .. KILL_AT-1, 3 after), exactly (small integers in float64).
"""
from __future__ import annotations

import os
import socket

import numpy as np
from mpi4py import MPI

import mpicoll
import mpicoll.elastic as elastic

STEPS = 6
KILL_AT = 3
VICTIM = 3


def contribution(rank: int, step: int) -> np.ndarray:
    return np.arange(7, dtype=np.float64) * (rank + 1) + 10 * step + rank


def main() -> None:
    me = MPI.COMM_WORLD.Get_rank()
    state = elastic.ObjectState(step=0, total=np.zeros(7))

    @elastic.run(min_np=2)
    def train(state: elastic.ObjectState) -> None:
        while state.step < STEPS:
            if me == VICTIM and state.step == KILL_AT:
                os.kill(os.getpid(), 9)
            state.total = state.total + mpicoll.allreduce(contribution(me, state.step),
                                                          op="sum")
            state.step += 1
            state.commit()

    train(state)
    expected = np.zeros(7)
    for step in range(STEPS):
        alive = range(4) if step < KILL_AT else [r for r in range(4) if r != VICTIM]
        expected += sum(contribution(r, step) for r in alive)
    recovery = elastic.last_recovery()
    failed = recovery.failed if recovery is not None else []
    ok = np.array_equal(state.total, expected)
    print(f"RESULT {me} {socket.gethostname()} size {elastic.world().Get_size()} failed "
          f"{','.join(map(str, failed)) or '-'} {'ok' if ok else 'WRONG'} "
          f"{state.total.tolist()}", flush=True)


if __name__ == "__main__":
    main()
