"""The programs the fault catalogue runs under mpirun (``python fault_scripts.py CASE``).

Each case makes one fault happen on purpose; ``tests/reliability/test_faults.py`` launches
it and asserts how, and how fast, the job ends. Rank 1 is the faulty rank throughout.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

import mpicoll

RANK = MPI.COMM_WORLD.Get_rank()
BAD = RANK == 1
BIG = np.ones(1 << 22)  # 32 MiB: an all-reduce that is still running when the fault hits


def warm_up() -> None:
    """Two matched collectives, so that the fault is not in the first call."""
    x = np.ones(16)
    mpicoll.allreduce(x)
    mpicoll.broadcast(x, root=0)


def raise_inside() -> None:
    """Rank 1 raises while the others are inside an all-reduce."""
    warm_up()
    if BAD:
        time.sleep(0.5)
        raise RuntimeError("rank 1 raises on purpose")
    mpicoll.allreduce(BIG, algorithm="ring")


def interrupted_inside() -> None:
    """Rank 1 raises inside a 32 MiB all-reduce (from a signal handler, as a SIGTERM or
    SIGINT handler would), and its process ends; the others wait in that call."""
    warm_up()
    if BAD:
        signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(
            RuntimeError("rank 1 interrupted on purpose")))
        signal.setitimer(signal.ITIMER_REAL, 0.05)
    for _ in range(1000):
        mpicoll.allreduce(BIG, algorithm="ring")


def truncated_inside() -> None:
    """Rank 0 sends more than the others expect (MPI's all-reduce, unchecked): rank 1's
    MPI raises 'message truncated' and its process ends; the others wait in that call."""
    warm_up()
    mpicoll.allreduce(np.ones(13 if RANK == 0 else 11), algorithm="native")


def sigkill_inside() -> None:
    """Rank 1 is SIGKILLed in the middle of a 32 MiB all-reduce."""
    warm_up()
    if BAD:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGKILL))
    for _ in range(1000):
        mpicoll.allreduce(BIG, algorithm="ring")


def sleep_past_warning() -> None:
    """Rank 1 sleeps past MPICOLL_STALL_WARN_SECONDS before an all-reduce; then all goes on."""
    warm_up()
    if BAD:
        time.sleep(float(os.environ["FAULT_SLEEP"]))
    mpicoll.allreduce(np.ones(100), algorithm="ring")
    print(f"rank {RANK} finished", flush=True)


MISMATCHES = {  # kind -> (good rank's call, rank 1's call)
    "count": (lambda: mpicoll.allreduce(np.ones(1000), algorithm="ring"),
              lambda: mpicoll.allreduce(np.ones(999), algorithm="ring")),
    "dtype": (lambda: mpicoll.allreduce(np.ones(1000), algorithm="ring"),
              lambda: mpicoll.allreduce(np.ones(1000, np.float32), algorithm="ring")),
    "op": (lambda: mpicoll.allreduce(np.ones(1000), op="sum", algorithm="ring"),
           lambda: mpicoll.allreduce(np.ones(1000), op="max", algorithm="ring")),
    "root": (lambda: mpicoll.broadcast(np.ones(1000), root=0, algorithm="binomial"),
             lambda: mpicoll.broadcast(np.ones(1000), root=1, algorithm="binomial")),
    "algorithm": (lambda: mpicoll.allreduce(np.ones(1000), algorithm="ring"),
                  lambda: mpicoll.allreduce(np.ones(1000), algorithm="recursive_doubling")),
}


def disagree(kind: str) -> None:
    """Rank 1 disagrees on one argument; then it is late for the next, matched, call.

    The disagreeing call may hang, fail or (silently wrong) complete, depending on the
    algorithm: whichever happens, a later wait lets the inspector report it.
    """
    warm_up()
    good, bad = MISMATCHES[kind]
    try:
        (bad if BAD else good)()
    except Exception as exc:  # noqa: BLE001  (an MPI error is one possible outcome)
        print(f"rank {RANK}: the mismatched call raised {exc!r}", flush=True)
    if BAD:
        time.sleep(float(os.environ["FAULT_SLEEP"]))
    mpicoll.allreduce(np.ones(10), algorithm="ring")


def disagree_checked() -> None:
    """Every kind of disagreement in checked mode: MismatchError on every rank, each time."""
    warm_up()
    for kind, (good, bad) in MISMATCHES.items():
        try:
            (bad if BAD else good)()
        except mpicoll.MismatchError as exc:
            print(f"rank {RANK} {kind}: MismatchError: {exc}", flush=True)
        else:
            print(f"rank {RANK} {kind}: no error", flush=True)


def exit_normally(how: str) -> None:
    """Rank 1 ends (its script returns, or sys.exit) while the others wait in a collective."""
    warm_up()
    if BAD:
        if how == "sys.exit":
            sys.exit(0)
        return
    mpicoll.allreduce(np.ones(100), algorithm="ring")


CASES = {"raise": raise_inside, "sigkill": sigkill_inside, "sleep": sleep_past_warning,
         "interrupted": interrupted_inside, "truncated": truncated_inside,
         "checked": disagree_checked,
         "return": lambda: exit_normally("return"), "sys.exit": lambda: exit_normally("sys.exit")}

if __name__ == "__main__":
    case = sys.argv[1]
    if case.startswith("disagree:"):
        disagree(case.split(":", 1)[1])
    else:
        CASES[case]()
