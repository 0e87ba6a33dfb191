"""The parameter server under process failures (Open MPI with ULFM), issue 24 item 6.

Each case is one ``mpirun --with-ft ulfm`` job of ps_replica_worker.py (see its docstring):

- ``failover``: the primary server of a slot dies mid-training with ``replicas=1``; the
  workers fail over to the backup and finish, every value they pulled equal bit for bit
  to the single-process reference of the same update sequence (no acknowledged update
  lost, none applied twice), and the spare server became the slot's new backup;
- ``dead-worker``: a worker dies under ``bsp`` with ``replicas=1``; the rounds go on with
  the two others, equal bit for bit to the reference where the dead worker stops
  contributing at the round it never pushed;
- ``pfe-server`` / ``pfe-worker``: without replicas, a dead server or worker makes every
  survivor raise :class:`mpicoll.ProcessFailedError` naming it within :data:`BOUND_S`.

The jobs run two at a time first, then each case checks its own output.
"""
from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest

import ompi_env
from mpi_launcher import run_command

WORKER = Path(__file__).with_name("ps_replica_worker.py")

#: Seconds from the kill to the error on every survivor (issue 24's bound).
BOUND_S = 2.0
#: Seconds one job may take (a hang means a survivor never went on, or never raised).
JOB_TIMEOUT_S = 40
PARALLEL = 2

#: case -> (world size, killed rank, what each survivor must print)
CASES = {
    "failover": (5, 0, {1: "served", 2: "served", 3: "equal", 4: "equal"}),
    "dead-worker": (5, 4, {0: "served", 1: "served", 2: "equal", 3: "equal"}),
    "pfe-server": (4, 0, {1: "pfe", 2: "pfe", 3: "pfe"}),
    "pfe-worker": (4, 3, {0: "pfe", 1: "pfe", 2: "pfe"}),
}


@pytest.fixture(scope="module")
def outputs() -> dict[str, tuple[int, str, float]]:
    python = ompi_env.ompi_python()

    def run(case: str) -> tuple[int, str, float]:
        n = CASES[case][0]
        rc, out, secs = run_command(ompi_env.mpirun_command(python, n, [str(WORKER), case]),
                                    ompi_env.ompi_env(), JOB_TIMEOUT_S)
        return 124 if rc is None else rc, out, secs

    with concurrent.futures.ThreadPoolExecutor(PARALLEL) as pool:
        futures = {case: pool.submit(run, case) for case in CASES}
        return {case: f.result() for case, f in futures.items()}


def parse(out: str) -> tuple[float | None, dict[int, list[str]], dict[int, list[float]]]:
    """(kill time, rank -> RESULT fields, rank -> step completion times)."""
    kill = [float(line.split()[1]) for line in out.splitlines() if line.startswith("KILL ")]
    results, done = {}, {}
    for line in out.splitlines():
        fields = line.split()
        if line.startswith("RESULT "):
            results[int(fields[1])] = fields[2:]
        elif line.startswith("DONE "):
            done[int(fields[1])] = [float(x) for x in fields[2:]]
    return (kill[0] if len(kill) == 1 else None), results, done


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_ps_fault(outputs, case) -> None:
    rc, out, secs = outputs[case]
    n, victim, want = CASES[case]
    kill, results, done = parse(out)
    tail = "\n".join(out.splitlines()[-25:])
    print(f"{case}: job {secs:.1f} s\n{tail}")
    assert kill is not None, f"{case}: no KILL line (rc={rc})\n{tail}"
    problems = []
    for rank, kind in want.items():
        got = results.get(rank)
        if got is None:
            problems.append(f"rank {rank}: no result (hung or died)")
        elif got[0] != kind:
            problems.append(f"rank {rank}: {' '.join(got)} (wanted {kind})")
        elif kind == "pfe":
            if got[1] != str(victim):
                problems.append(f"rank {rank}: named {got[1]}, not {victim}")
            elif float(got[2]) - kill > BOUND_S:
                problems.append(f"rank {rank}: raised {float(got[2]) - kill:.2f} s after "
                                f"the kill (bound {BOUND_S} s)")
        elif kind == "served" and case == "failover" and got[1] != "1":
            problems.append(f"rank {rank}: {got[1]} slot changes, expected 1")
    assert not problems, f"{case} (rc={rc}, {secs:.1f} s): {problems}\n{tail}"
    if done:   # informative: failure -> first step completed after it, per worker
        gaps = [min((t for t in times if t > kill), default=float("nan")) - kill
                for times in done.values()]
        print(f"{case}: kill -> next completed step: " +
              ", ".join(f"{g:.3f} s" for g in gaps))
