"""A numpy training loop under ``mpicoll.elastic`` that grows when discovery reports more
slots (run by test_elastic_grow.py under ``mpirun --with-ft ulfm``, not by pytest).

Usage: ``python elastic_grow_worker.py STEPS GROW_STEP SLOTS MAX_NP HOSTFILE GARBAGE_STEP
[VICTIM KILL_STEP]``.

The discovery is a script, ``sh -c 'cat HOSTFILE; touch HOSTFILE.seen'`` (horovodrun's
format, polled by rank 0 every 0.2 s). At step ``GROW_STEP`` (``-1``: never) the original
rank 0 writes ``localhost:SLOTS`` into ``HOSTFILE``, at step ``GARBAGE_STEP`` (``-1``:
never) a line that is no host, and each time waits until the script has read it.
``VICTIM`` (an original rank) SIGKILLs itself at step ``KILL_STEP``.

Every step all-reduces (``comm=None``: the world in force) a vector that depends on the
rank in that world and the step, and checks the sum exactly against its closed form for
the world's size (a wrong sum prints ``BAD`` and aborts); the state adds it and counts the
world's size per step. Output lines:

- ``CAPACITY <time>``: the host file now offers ``SLOTS``;
- ``COMMITTED <rank> <size> <step> <digest> <time>``: a commit raised HostsUpdatedInterrupt;
- ``ENTER <rank> <size> <step> <digest> <joined>``: the elastic function (re)starts,
  after the sync (``digest``: sha256 of the state's bytes);
- ``FIRST <rank> <size> <time>``: the first step completed after a growth;
- ``DONE <rank> <size> <step> <total> <digest> <joined> <growth phases>``;
- ``DISCOVERYERROR <rank> <size> <step> <total> <digest> <message>`` (exit status 4) when
  discovery failed.
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


def say(line: str) -> None:
    """Print ``line`` in one write (two ranks' lines never run together, also under
    MPICH's launcher, which forwards each write as it comes)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    steps, grow_step = int(sys.argv[1]), int(sys.argv[2])
    slots, max_np, hostfile = sys.argv[3], int(sys.argv[4]), Path(sys.argv[5])
    garbage_step = int(sys.argv[6])
    victim = int(sys.argv[7]) if len(sys.argv) > 7 else -1
    kill_step = int(sys.argv[8]) if len(sys.argv) > 8 else -1
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
        say(f"ENTER {world.Get_rank()} {world.Get_size()} {state.step} {digest(state)} "
            f"{int(not original)}")
        if not original:
            grown["pending"] = True
        while state.step < steps:
            if me == victim and state.step == kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            if original and me == 0 and state.step in (grow_step, garbage_step):
                written = time.time()
                hostfile.write_text(f"localhost:{slots}\n" if state.step == grow_step
                                    else "this is no host line!\n")
                say(f"CAPACITY {written:.6f}")
                while not seen.exists() or seen.stat().st_mtime < written:
                    time.sleep(0.01)
            world = elastic.world()
            rank, size = world.Get_rank(), world.Get_size()
            grad = np.arange(N, dtype=np.float64) * (rank + 1) + state.step
            total = mpicoll.allreduce(grad, op="sum", algorithm="ring")
            want = np.arange(N, dtype=np.float64) * (size * (size + 1) // 2) + size * state.step
            if not np.array_equal(total, want):
                say(f"BAD {rank} {size} step {state.step}: wrong sum")
                world.Abort(5)
            state.weights += total * 1e-3
            state.total += size
            state.step += 1
            if grown["pending"]:
                grown["pending"] = False
                say(f"FIRST {rank} {size} {time.time():.6f}")
            if 0 <= garbage_step <= state.step:
                time.sleep(0.01)            # give the poller time to fail, three times
            try:
                state.commit()
            except elastic.HostsUpdatedInterrupt:
                say(f"COMMITTED {rank} {size} {state.step} {digest(state)} {time.time():.6f}")
                raise

    try:
        train(state)
    except elastic.DiscoveryError as exc:
        world = elastic.world()
        say(f"DISCOVERYERROR {world.Get_rank()} {world.Get_size()} {state.step} "
            f"{state.total} {digest(state)} {exc}")
        world.Barrier()                    # every rank prints before any exits
        sys.exit(4)
    world = elastic.world()
    growth = elastic.last_growth()
    say(f"DONE {world.Get_rank()} {world.Get_size()} {state.step} {state.total} "
        f"{digest(state)} {int(not original)} {'-' if growth is None else growth.summary()}")


if __name__ == "__main__":
    main()
