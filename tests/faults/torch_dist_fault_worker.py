"""One fault case of the torch.distributed backend under ``mpirun --with-ft ulfm`` (run by
test_torch_dist_faults.py, not by pytest).

Usage: ``python torch_dist_fault_worker.py OP VICTIM [STATUS]``: every rank starts
``dist.init_process_group("mpicoll")`` and runs the backend operation ``OP`` in a loop;
rank ``VICTIM`` SIGKILLs itself from a timer thread once the loop runs (so the death lands
inside an operation). Output lines as ulfm_worker.py's (fault_report.py): ``KILL <time>``;
``RESULT <rank> pfe <failed ranks> <time>`` from a survivor whose operation raised
:class:`mpicoll.ProcessFailedError`. Then each survivor checks that the group is unusable
(``AFTER <rank> pfe|other|none <seconds> <error>``: another all-reduce on the default group
must raise ProcessFailedError at once), shrinks the world and meets the other survivors,
and ends (``EXITING <rank>``) with a bare ``raise SystemExit(STATUS)`` (default 0): the job
must end with that status, without hanging in ``MPI_Finalize``, and the exit handler
registered before mpicoll was imported must run (``ATEXIT <rank>``).

``timeout``, ``abort``: no rank dies; see :func:`broken`.

``recv_live``: every rank waits for a message from its right neighbour that never sends
it. ``blocked``: the first survivor waits for such a message from the second, which waits
in a barrier (MPI's, on the group's thread) that the first never joins: survivors blocked
on survivors, which only the group's failure watch and the revocation it sends can end.
"""
from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from datetime import timedelta

atexit.register(lambda: print(f"ATEXIT {os.environ.get('OMPI_COMM_WORLD_RANK')}",
                              flush=True))   # before mpicoll is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpicoll  # noqa: E402
import mpicoll.torch  # noqa: F401, E402  (registers "mpicoll")
from fault_report import report  # noqa: E402
from mpicoll.torch.distributed import monitored_barrier, split_group  # noqa: E402

#: Calls of the operation before the victim starts its kill timer.
CALLS_BEFORE_KILL = 3
#: Seconds the timer waits (the victim is then inside a later call).
KILL_DELAY_S = 0.05
LOOP_S = 10.0


def _ring(rank: int, n: int, t: torch.Tensor, r: torch.Tensor, batched: bool):
    right, left = (rank + 1) % n, (rank - 1) % n
    if batched:
        def call() -> None:
            ops = [dist.P2POp(dist.isend, t, right), dist.P2POp(dist.irecv, r, left)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return call

    def call() -> None:
        works = [dist.isend(t, right), dist.irecv(r, left)]
        for work in works:
            work.wait()
    return call


def make_call(op: str, rank: int, n: int, victim: int):
    """The operation ``op`` as a function of no arguments (rank-dependent data)."""
    t = torch.arange(4096, dtype=torch.float32) + rank
    r = torch.empty_like(t)
    if op == "allreduce":
        return lambda: dist.all_reduce(t)
    if op == "broadcast":
        return lambda: dist.broadcast(t, src=0)
    if op == "reduce":
        return lambda: dist.reduce(t, dst=0)
    if op == "allgather":
        outs = [torch.empty_like(t) for _ in range(n)]
        return lambda: dist.all_gather(outs, t)
    if op == "reduce_scatter":
        big = torch.arange(64 * n, dtype=torch.float32) + rank
        out = torch.empty(64)
        return lambda: dist.reduce_scatter_tensor(out, big)
    if op == "gather":
        outs = [torch.empty_like(t) for _ in range(n)] if rank == 0 else None
        return lambda: dist.gather(t, outs, dst=0)
    if op == "scatter":
        ins = [t + i for i in range(n)] if rank == 0 else None
        return lambda: dist.scatter(r, ins, src=0)
    if op == "alltoall":
        ins = [t[:100] + i for i in range(n)]
        outs = [torch.empty(100) for _ in range(n)]
        return lambda: dist.all_to_all(outs, ins)
    if op == "alltoall_single":
        big = torch.arange(64 * n, dtype=torch.float32) + rank
        out = torch.empty_like(big)
        return lambda: dist.all_to_all_single(out, big)
    if op == "barrier":
        return lambda: dist.barrier()
    if op == "monitored_barrier":
        return lambda: monitored_barrier(timeout=timedelta(seconds=30))
    if op == "sendrecv":
        return _ring(rank, n, t, r, batched=False)
    if op == "batch_isend_irecv":
        return _ring(rank, n, t, r, batched=True)
    if op == "recv_live":
        return lambda: dist.recv(r, src=(rank + 1) % n, tag=7)
    if op == "blocked":
        first, second = [x for x in range(n) if x != victim][:2]
        if rank == first:
            return lambda: dist.recv(r, src=second, tag=7)
        return lambda: dist.barrier()
    if op == "object":
        out: list = [None] * n
        objs = [{"rank": rank}]
        return lambda: (dist.all_gather_object(out, {"rank": rank}),
                        dist.broadcast_object_list(objs, src=0))
    if op == "new_group":
        return lambda: dist.new_group(list(range(n)))
    if op == "new_subgroup":     # only the victim and the lowest other rank are members
        members = sorted({victim, min(set(range(n)) - {victim})})
        if rank in members:
            return lambda: dist.new_group(members, use_local_synchronization=True)
        return lambda: dist.all_reduce(t)
    if op == "split_group":
        return lambda: split_group(split_ranks=[list(range(n))])
    if op == "async_future":   # the error through Work.get_future() of an async call
        def call() -> None:
            fut = dist.all_reduce(t, async_op=True).get_future()
            fut.wait()
        return call
    raise SystemExit(f"unknown op {op!r}")


def _die() -> None:
    print(f"KILL {time.time():.6f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def broken(op: str, skipper: int) -> None:
    """``timeout``/``abort`` (nobody dies): rank ``skipper`` skips an all-reduce; on each
    other rank ``wait(timeout=1 s)`` expires (``timeout``), or a timer aborts the group
    after 1 s (``abort``). The wait must raise at once, and the all-reduce in flight must
    end too (the revocation: MPI cannot cancel it otherwise). Prints ``BROKEN <rank>
    <error type> <seconds until it raised> <seconds until the group's lane was free>``."""
    rank = dist.get_rank()
    pg = dist.group.WORLD
    dist.all_reduce(torch.ones(2))
    if rank == skipper:
        time.sleep(4)
        return
    work = dist.all_reduce(torch.ones(2), async_op=True)
    start = time.monotonic()
    if op == "abort":
        threading.Timer(1.0, pg.abort).start()
    try:
        work.wait(timedelta(seconds=1 if op == "timeout" else 30))
        error = "none"
    except Exception as exc:  # noqa: BLE001
        error = type(exc).__name__
    raised = time.monotonic() - start
    while pg._get_backend(torch.device("cpu"))._lane.completed < 2 and time.monotonic() < start + 10:
        time.sleep(0.01)
    print(f"BROKEN {rank} {error} {raised:.2f} {time.monotonic() - start:.2f}", flush=True)


def main() -> None:
    op, victim = sys.argv[1], int(sys.argv[2])
    status = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    dist.init_process_group("mpicoll")
    rank, n = dist.get_rank(), dist.get_world_size()
    if op in ("timeout", "abort"):
        broken(op, victim)
        print(f"EXITING {rank}", flush=True)
        raise SystemExit(status)
    call = make_call(op, rank, n, victim)
    start = time.time()
    try:
        for i in range(1 << 30):
            blocks = op in ("recv_live", "blocked")   # the first call never returns
            if rank == victim and i == (0 if blocks else CALLS_BEFORE_KILL):
                threading.Timer(0.5 if blocks else KILL_DELAY_S, _die).start()
            call()
            if i > CALLS_BEFORE_KILL and time.time() > start + LOOP_S:
                break
        report(rank)
    except Exception as exc:  # noqa: BLE001
        report(rank, exc)
    # the group is unusable now: the next operation fails at once, naming the same rank
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(3))
        after = "none"
    except Exception as exc:  # noqa: BLE001
        after = ("pfe" if isinstance(exc, mpicoll.ProcessFailedError)
                 else f"other {type(exc).__name__}: {str(exc)[:160]}")
    print(f"AFTER {rank} {after.split()[0]} {time.monotonic() - t0:.3f} {after}", flush=True)
    MPI.COMM_WORLD.Shrink().Barrier()
    print(f"EXITING {rank}", flush=True)
    raise SystemExit(status)   # bare: the status must reach the job's (not 0)


if __name__ == "__main__":
    main()
