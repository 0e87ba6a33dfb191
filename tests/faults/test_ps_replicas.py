"""The parameter server under process failures (Open MPI with ULFM), issue 24 item 6.

Each case is one ``mpirun --with-ft ulfm`` job of ps_replica_worker.py (see its docstring):

- ``replicas``: with ``replicas=1`` the primary server of a slot dies mid-training; the
  workers fail over to the backup, and the spare server becomes the slot's new backup;
  later a worker dies under ``bsp`` and the rounds go on with the two others. Every value
  the surviving workers pulled equals bit for bit the single-process reference of the
  same update sequence (no acknowledged update lost, none applied twice; the dead
  worker's gradients stop at the round it never pushed);
- ``pfe-server`` / ``pfe-worker`` / ``pfe-colocated``: without replicas, a dead server or
  worker (or, co-located, a dead rank) makes every survivor raise
  :class:`mpicoll.ProcessFailedError` naming it within :data:`BOUND_S`;
- ``pfe-node`` / ``pfe-node-leader`` (issue 32): the same with local aggregation, 5 ranks
  on emulated nodes of 2 (server 0; worker nodes {1}, {2, 3}, {4}); rank 3 dies (its
  node's leader, rank 2, then waits on it for the node's gradients), or the leader, rank 2,
  does (rank 3 then waits on it for the values). Every survivor, the dead rank's node
  partner included, raises ``ProcessFailedError`` naming it within :data:`BOUND_S` (the
  partner used to get a raw ``mpi4py.MPI.Exception``: the node communicator was neither
  revoked nor watched).

The jobs run two at a time first, then each case checks its own output. Fails, not
skips, when Open MPI with ULFM cannot run.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import ompi_env
from ulfm_jobs import run_jobs

WORKER = Path(__file__).with_name("ps_replica_worker.py")

#: Seconds from the kill to the error on every survivor (issue 24's bound).
BOUND_S = 2.0
#: Seconds one job may take (a hang means a survivor never went on, or never raised).
JOB_TIMEOUT_S = 60
NODES = {"MPICOLL_RANKS_PER_NODE": "2"}

#: case -> (world size, killed ranks, what each survivor must print, environment)
CASES = {
    "replicas": (6, (0, 5), {1: "served", 2: "served", 3: "equal", 4: "equal"}, {}),
    "pfe-server": (3, (0,), {1: "pfe", 2: "pfe"}, {}),
    "pfe-worker": (3, (2,), {0: "pfe", 1: "pfe"}, {}),
    "pfe-colocated": (3, (2,), {0: "pfe", 1: "pfe"}, {}),
    "pfe-node": (5, (3,), {0: "pfe", 1: "pfe", 2: "pfe", 4: "pfe"}, NODES),
    "pfe-node-leader": (5, (2,), {0: "pfe", 1: "pfe", 3: "pfe", 4: "pfe"}, NODES),
}


@pytest.fixture(scope="module")
def outputs() -> dict[str, tuple[int, str, float]]:
    python = ompi_env.ompi_python()
    return run_jobs(python, {case: (WORKER, n, [case], env, JOB_TIMEOUT_S)
                             for case, (n, _, _, env) in CASES.items()})


def parse(out: str) -> tuple[list[float], dict[int, list[str]], dict[int, list[float]]]:
    """(kill times, rank -> RESULT fields, rank -> step completion times)."""
    kill = [float(line.split()[1]) for line in out.splitlines() if line.startswith("KILL ")]
    results, done = {}, {}
    for line in out.splitlines():
        fields = line.split()
        if line.startswith("RESULT "):
            results[int(fields[1])] = fields[2:]
        elif line.startswith("DONE "):
            done[int(fields[1])] = [float(x) for x in fields[2:]]
    return kill, results, done


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_ps_fault(outputs, case) -> None:
    rc, out, secs = outputs[case]
    n, victims, want, _ = CASES[case]
    kills, results, done = parse(out)
    tail = "\n".join(out.splitlines()[-25:])
    print(f"{case}: job {secs:.1f} s\n{tail}")
    assert len(kills) == len(victims), f"{case}: {len(kills)} KILL lines (rc={rc})\n{tail}"
    problems = []
    for rank, kind in want.items():
        got = results.get(rank)
        if got is None:
            problems.append(f"rank {rank}: no result (hung or died)")
        elif got[0] != kind:
            problems.append(f"rank {rank}: {' '.join(got)} (wanted {kind})")
        elif kind == "pfe":
            if got[1] != str(victims[0]):
                problems.append(f"rank {rank}: named {got[1]}, not {victims[0]}")
            elif float(got[2]) - kills[0] > BOUND_S:
                problems.append(f"rank {rank}: raised {float(got[2]) - kills[0]:.2f} s after "
                                f"the kill (bound {BOUND_S} s)")
        elif kind == "served" and got[1] != "1":
            problems.append(f"rank {rank}: {got[1]} slot changes, expected 1")
    assert not problems, f"{case} (rc={rc}, {secs:.1f} s): {problems}\n{tail}"
    for kill in kills if done else []:   # informative: a kill -> the next completed step
        gaps = [min((t for t in times if t > kill), default=float("nan")) - kill
                for times in done.values()]
        print(f"{case}: kill at {kill:.3f} -> next completed step: " +
              ", ".join(f"{g:.3f} s" for g in gaps))
