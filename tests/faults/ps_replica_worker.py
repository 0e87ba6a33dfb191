"""One parameter-server fault case under ``mpirun --with-ft ulfm`` (run by
test_ps_replicas.py, not by pytest).

Usage: ``python ps_replica_worker.py CASE``:

- ``replicas``: 6 ranks, 3 servers with ``replicas=1`` (so a spare is left), 3 workers,
  ``bsp`` with Adam. Server rank 0 (primary of slot 0, backup of slot 2) SIGKILLs itself
  once its slot has applied :data:`KILL_AT` rounds; the workers go on (failover). Later
  the last worker (rank 5) SIGKILLs itself before pushing step :data:`WORKER_KILL_AT`;
  the two others go on, their rounds from then on averaging their two gradients. Each
  surviving worker checks every value it pulled against the single-process reference of
  that update sequence, bit for bit (``RESULT <rank> equal <steps>``; ``DONE <rank>
  <times>``: when each of its steps completed).
- ``pfe-server`` / ``pfe-worker``: 3 ranks, 1 server, ``replicas=0``, ``bsp``: the server
  (rank 0) or a worker (rank 2) dies; every survivor must raise
  :class:`mpicoll.ProcessFailedError` naming it (``RESULT <rank> pfe <ranks> <time>``).
  ``pfe-colocated``: the same with ``num_servers="colocated"`` (rank 2 dies).
  ``pfe-node`` / ``pfe-node-leader``: 5 ranks with ``MPICOLL_RANKS_PER_NODE=2``, 1 server,
  ``local_aggregation=True`` (worker nodes {1}, {2, 3}, {4}): rank 3, or its node's
  leader rank 2, dies.

Each victim prints ``KILL <time>`` just before it dies. Survivors shrink the world and
meet before exiting, so none looks failed to another still collecting failed ranks.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from fault_report import report
from mpicoll.ps import ParameterServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ps" / "mpi"))
from ps_cases import adam_update, make_grads, make_params, reference_bsp  # noqa: E402

STEPS = 14
KILL_AT = 4
WORKER_KILL_AT = 9
SMALL = dict(chunk_bytes=96, split_bytes=64)


def kill(note: str = "") -> None:
    print(f"KILL {time.time():.6f} {note}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def kill_server_at(ps: ParameterServer, rounds: int) -> None:
    """SIGKILL this server once its own slot has applied ``rounds`` rounds (a thread that
    only reads Python state: no MPI call)."""
    def watch() -> None:
        group = ps._server.groups[ps.rank]
        while True:
            if min(st.version for st in group.states.values()) >= rounds:
                kill(f"slot {ps.rank} at round {rounds}")
            time.sleep(0.0005)
    threading.Thread(target=watch, daemon=True).start()


def train(ps: ParameterServer, grads: list[list[dict]], die_at: int | None = None
          ) -> tuple[list[dict], list[float]]:
    seen, done = [ps.pull()], []
    for t in range(STEPS):
        if die_at is not None and t == die_at:
            kill(f"worker {ps.worker_index} before step {t}")
        seen.append(ps.push_pull(grads[t][ps.worker_index]))
        done.append(time.time())
    ps.close()
    return seen, done


def check(seen: list[dict], history: list[dict], params: dict) -> str | None:
    for t, want in enumerate([params] + history):
        for name in want:
            if not np.array_equal(seen[t][name], want[name]) or \
                    seen[t][name].dtype != want[name].dtype:
                return f"step {t} {name} differs"
    return None


def case_replicas(name: str) -> None:
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    params = make_params()
    servers = 3
    nworkers = world.Get_size() - servers
    grads = [[make_grads(params, w, t) for w in range(nworkers)] for t in range(STEPS)]
    victim_worker = nworkers - 1
    alive = [[g for w, g in enumerate(step) if t < WORKER_KILL_AT or w != victim_worker]
             for t, step in enumerate(grads)]
    history = reference_bsp(params, alive, adam_update(0.01, 0.9, 0.99, 1e-6))
    ps = ParameterServer(params, comm=world, num_servers=servers, consistency="bsp",
                         replicas=1, optimizer="adam", lr=0.01, beta1=0.9, beta2=0.99,
                         eps=1e-6, **SMALL)
    if ps.is_server:
        if rank == 0:
            kill_server_at(ps, KILL_AT)
        ps.serve()
        print(f"RESULT {rank} served {len(ps._server.failovers)}", flush=True)
        return
    die = WORKER_KILL_AT if ps.worker_index == victim_worker else None
    seen, done = train(ps, grads, die)
    problem = check(seen, history, params)
    print(f"DONE {rank} " + " ".join(f"{x:.6f}" for x in done), flush=True)
    print(f"RESULT {rank} " + (f"differs {problem}" if problem else f"equal {STEPS}"),
          flush=True)


#: the rank each ``pfe-*`` case kills
VICTIMS = {"pfe-server": 0, "pfe-worker": 2, "pfe-colocated": 2, "pfe-node": 3,
           "pfe-node-leader": 2}


def case_pfe(name: str) -> None:
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    params = make_params()
    victim = VICTIMS[name]
    ps = ParameterServer(params, comm=world,
                         num_servers="colocated" if name == "pfe-colocated" else 1,
                         consistency="bsp", optimizer="sgd", lr=0.125,
                         local_aggregation=name.startswith("pfe-node"), **SMALL)
    if name.startswith("pfe-node") and ps.node_groups != [[1], [2, 3], [4]]:
        raise RuntimeError(f"node groups {ps.node_groups} (MPICOLL_RANKS_PER_NODE=2?)")
    try:
        if ps.is_server:
            if rank == victim:
                threading.Timer(0.5, kill, ("server",)).start()
            ps.serve()
        else:
            ps.pull()
            for t in range(1 << 20):
                if rank == victim and t == KILL_AT:
                    kill("worker")
                ps.push_pull(make_grads(params, ps.worker_index, t % 7))
        report(rank)
    except Exception as exc:  # noqa: BLE001
        report(rank, exc)


def main() -> None:
    name = sys.argv[1]
    try:
        if name.startswith("pfe-"):
            case_pfe(name)
        else:
            case_replicas(name)
    except Exception as exc:  # noqa: BLE001
        msg = str(exc).replace("\n", " ")[:200]
        print(f"RESULT {MPI.COMM_WORLD.Get_rank()} other {type(exc).__name__} {msg}",
              flush=True)
    try:
        MPI.COMM_WORLD.Shrink().Barrier()
    finally:
        os._exit(0)


if __name__ == "__main__":
    main()
