"""One world, every client of the runtime, a rank lost: every communicator of the old world
is revoked and released, and none is alive at exit (issue 32; Open MPI with ULFM, n = 3).

The worker (runtime_world_worker.py) uses the synchronous collectives, hvd, local SGD, a
codec, torch.distributed groups and a parameter server, then rank 2 dies and the survivors
shrink the world. Fails, not skips, when Open MPI with ULFM cannot run.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import ompi_env
from test_ulfm import survivors_report
from ulfm_jobs import OPEN_MPI_CREATE_CRASH, lines, run_job, run_jobs

HERE = Path(__file__).resolve().parent
#: The runtime's communicator owners every client must have used.
OWNERS = {"context", "topology", "engine", "group", "ps"}


@pytest.fixture(scope="module")
def job():
    python = ompi_env.ompi_python(need_torch=True)
    return run_job(python, (HERE / "runtime_world_worker.py", 3, [], {}, 150.0))


def test_every_client_gets_its_communicators_from_the_runtime(job):
    rc, out, _ = job
    owners = lines(out, "OWNERS")
    assert len(owners) == 3, out[-3000:]
    for fields in owners:
        assert OWNERS <= set(fields[1].split(",")), (fields, out[-2000:])


def test_the_old_worlds_communicators_are_revoked_and_released(job):
    rc, out, _ = job
    assert sorted(f[0] for f in lines(out, "PFE")) == ["0", "1"], out[-3000:]
    assert all(f[1] == "2" for f in lines(out, "PFE")), out[-3000:]
    old = lines(out, "OLD")
    assert sorted(f[0] for f in old) == ["0", "1"], out[-3000:]
    for fields in old:
        assert fields[1:] == ["0", "0", "0", "-"], (fields, out[-2000:])
    assert sorted(lines(out, "NEW")) == [["0", "2", "4"], ["1", "2", "4"]], out[-3000:]


def test_no_communicator_is_alive_at_exit(job):
    rc, out, _ = job
    alive = lines(out, "ALIVE")
    assert sorted(f[0] for f in alive) == ["0", "1"], out[-3000:]
    assert all(f[1] == "-" for f in alive), (alive, out[-2000:])


#: Jobs of dup_kill_worker.py (Open MPI's MPI_Comm_dup crashed in about half of them; its
#: MPI_Comm_split under the runtime in 3 of 16 hand-run jobs, 2026-12-07: six jobs all
#: crashing, which fails the test, about 0.01% at that rate).
DUP_JOBS = 6


@pytest.fixture(scope="module")
def dup_jobs():
    python = ompi_env.ompi_python()
    return run_jobs(python, {i: (HERE / "dup_kill_worker.py", 3, [], {}, 60.0)
                             for i in range(DUP_JOBS)})


@pytest.mark.parametrize("i", range(DUP_JOBS))
def test_a_member_dead_during_duplicates_is_a_process_failure(dup_jobs, i):
    """Under ULFM the runtime's duplicates are MPI_Comm_split(0, rank): the same ranks in
    the same order, and a member that dies meanwhile is ProcessFailedError on every
    survivor, where Open MPI's MPI_Comm_dup crashed them (8 of 14 jobs)."""
    rc, out, _ = dup_jobs[i]
    crashed = [j for j, (_, o, _) in dup_jobs.items() if OPEN_MPI_CREATE_CRASH in o]
    if i in crashed:
        # Open MPI's own defect (its failure handler revokes the communicator it is still
        # making; with MPI_Comm_split in 12 of 75 hand-run jobs, 2026-12-07): the job says
        # nothing of mpicoll's handling, which the other jobs check
        assert len(crashed) < DUP_JOBS, "Open MPI crashed in every job: nothing checked"
        pytest.xfail(f"Open MPI crashed making a duplicate while a member died "
                     f"({OPEN_MPI_CREATE_CRASH}), in {len(crashed)} of {DUP_JOBS} jobs")
    order = {int(f[0]): f[1:] for f in lines(out, "ORDER")}
    assert order == {r: ["1", "1"] for r in range(3)}, out[-3000:]
    assert "Segmentation fault" not in out, out[-3000:]
    assert not survivors_report(("dup", "-", 3, 1), out), out[-3000:]
    assert rc != 124, out[-3000:]
