"""Ranks that die, or end late, while the others exit (run by test_exit_after_failure.py).

Usage: ``python exit_fault_worker.py RANKS WHEN`` under ``mpirun --with-ft ulfm -n 4``
with ``MPICOLL_RANKS_PER_NODE=2`` (two emulated nodes). Every rank trains a little on
mpicoll: all-reduces over the node layout (``hierarchical``, and ``shm``, whose
shared-memory windows are freed collectively at exit) and the stall inspector's private
communicators. Then training ends, and the ranks in ``RANKS`` (``2,3``: the last node)
go on a moment:

- ``WHEN=before``: they SIGKILL themselves; the others' own exit handler (registered
  after mpicoll's, so it runs first) waits until they are dead: they die before
  mpicoll's exit handlers run;
- ``WHEN=during``: they SIGKILL themselves :data:`LATE_S` after training, while the others
  wait for them in mpicoll's exit (the old code: in ``MPI_Finalize``);
- ``WHEN=late``: they end normally, :data:`LATE_S` after the others, longer than the
  bound on ``MPI_Finalize`` (set to :data:`FINALIZE_WAIT_S` here): nobody failed.

Output lines: ``TRAINED <rank>``; ``KILL <time>`` from each rank just before it kills
itself; ``EXITED <rank>`` from each process's last exit handler (registered before
mpicoll was imported).
"""
from __future__ import annotations

import atexit
import os
import signal
import sys
import time

atexit.register(lambda: print(f"EXITED {rank}", flush=True))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpicoll  # noqa: E402

#: Seconds after training until the ranks die (``during``) or end (``late``).
LATE_S = 2.0
#: The bound on ``MPI_Finalize`` in these jobs (shorter than mpicoll's, and than LATE_S).
FINALIZE_WAIT_S = 1.0

if hasattr(mpicoll, "runtime"):   # not the code before the runtime (mpicoll.faults)
    mpicoll.runtime.exit.FINALIZE_WAIT_S = FINALIZE_WAIT_S

chosen = {int(r) for r in sys.argv[1].split(",")}
when = sys.argv[2]
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
x = np.arange(4096, dtype=np.float64) + rank
y = np.empty_like(x)
for step in range(20):
    for algorithm in ("hierarchical", "shm", "ring"):
        mpicoll.allreduce(x, y, algorithm=algorithm)
expected = np.arange(4096, dtype=np.float64) * comm.Get_size() + sum(range(comm.Get_size()))
assert np.array_equal(y, expected), "wrong all-reduce"
mpicoll.allreduce(np.zeros(1), np.empty(1))          # every rank has trained
print(f"TRAINED {rank}", flush=True)

if rank in chosen:
    time.sleep(0.3 if when == "before" else LATE_S)
    if when != "late":
        print(f"KILL {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
elif when == "before":
    atexit.register(time.sleep, 1.0)                 # runs before mpicoll's exit handlers
