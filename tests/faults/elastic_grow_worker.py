"""A numpy training loop under ``mpicoll.elastic`` that grows when discovery reports more
slots (run by test_elastic_grow.py under ``mpirun --with-ft ulfm``, not by pytest).

Usage: ``python elastic_grow_worker.py STEPS GROW_STEP SLOTS MAX_NP HOSTFILE [VICTIM
KILL_STEP]``.

The discovery is a script, ``sh -c 'cat HOSTFILE; touch HOSTFILE.seen'`` (horovodrun's
format, polled by rank 0 every 0.2 s). At step ``GROW_STEP`` (``-1``: never) the original
rank 0 writes ``localhost:SLOTS`` into ``HOSTFILE`` (``SLOTS`` ``garbage``: a line that is
no host) and waits until the script has read it. ``VICTIM`` (an original rank) SIGKILLs
itself at step ``KILL_STEP``.

Every step all-reduces (``comm=None``: the world in force) a vector that depends on the
rank in that world and the step, and checks the sum exactly against its closed form for
the world's size (a wrong sum prints ``BAD`` and aborts); the state adds it and counts the
world's size per step. Output lines:

- ``CAPACITY <time>``: the host file now offers ``SLOTS``;
- ``COMMITTED <rank> <size> <step> <digest>``: a commit raised HostsUpdatedInterrupt;
- ``ENTER <rank> <size> <step> <digest> <joined>``: the elastic function (re)starts,
  after the sync (``digest``: sha256 of the state's bytes);
- ``FIRST <rank> <size> <time>``: the first step completed after a growth;
- ``DONE <rank> <size> <step> <total> <digest> <joined> <growth phases>``;
- ``DISCOVERYERROR <rank> <message>`` (exit status 4) when discovery failed.
"""
from __future__ import annotations

import hashlib
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

import mpicoll
import mpicoll.elastic as elastic

N = 1001


def digest(state: elastic.ObjectState) -> str:
    h = hashlib.sha256(state.weights.tobytes())
    h.update(f"{state.step},{state.total}".encode())
    return h.hexdigest()[:16]


def main() -> None:
    steps, grow_step = int(sys.argv[1]), int(sys.argv[2])
    slots, max_np, hostfile = sys.argv[3], int(sys.argv[4]), Path(sys.argv[5])
    victim = int(sys.argv[6]) if len(sys.argv) > 6 else -1
    kill_step = int(sys.argv[7]) if len(sys.argv) > 7 else -1
    original = not elastic.joined()
    me = MPI.COMM_WORLD.Get_rank() if original else -1      # original rank, for the kill
    seen = Path(f"{hostfile}.seen")
    script = f"sh -c 'cat {hostfile}; touch {seen}'"
    state = elastic.ObjectState(step=0, total=0, weights=np.zeros(N, np.float64))
    grown = {"pending": False}
    state.register_reset_callbacks([lambda: grown.update(pending=True)])

    @elastic.run(discovery=script, max_np=max_np, discovery_interval=0.2)
    def train(state: elastic.ObjectState) -> None:
        world = elastic.world()
        print(f"ENTER {world.Get_rank()} {world.Get_size()} {state.step} {digest(state)} "
              f"{int(not original)}", flush=True)
        if not original:
            grown["pending"] = True
        while state.step < steps:
            if me == victim and state.step == kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            if original and me == 0 and state.step == grow_step:
                written = time.time()
                hostfile.write_text("this is no host line!\n" if slots == "garbage"
                                    else f"localhost:{slots}\n")
                print(f"CAPACITY {written:.6f}", flush=True)
                while not seen.exists() or seen.stat().st_mtime < written:
                    time.sleep(0.01)
            world = elastic.world()
            rank, size = world.Get_rank(), world.Get_size()
            grad = np.arange(N, dtype=np.float64) * (rank + 1) + state.step
            total = mpicoll.allreduce(grad, op="sum", algorithm="ring")
            want = np.arange(N, dtype=np.float64) * (size * (size + 1) // 2) + size * state.step
            if not np.array_equal(total, want):
                print(f"BAD {rank} {size} step {state.step}: wrong sum", flush=True)
                world.Abort(5)
            state.weights += total * 1e-3
            state.total += size
            state.step += 1
            if grown["pending"]:
                grown["pending"] = False
                print(f"FIRST {rank} {size} {time.time():.6f}", flush=True)
            if slots == "garbage":
                time.sleep(0.01)            # give the poller time to fail, three times
            try:
                state.commit()
            except elastic.HostsUpdatedInterrupt:
                print(f"COMMITTED {rank} {size} {state.step} {digest(state)}", flush=True)
                raise

    try:
        train(state)
    except elastic.DiscoveryError as exc:
        world = elastic.world()
        print(f"DISCOVERYERROR {world.Get_rank()} {exc}", flush=True)
        world.Barrier()                    # every rank prints before any exits
        sys.exit(4)
    world = elastic.world()
    growth = elastic.last_growth()
    print(f"DONE {world.Get_rank()} {world.Get_size()} {state.step} {state.total} "
          f"{digest(state)} {int(not original)} {'-' if growth is None else growth.summary()}",
          flush=True)


if __name__ == "__main__":
    main()
