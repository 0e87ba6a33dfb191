"""Process failures in mpicoll.torch's engine thread (Open MPI with ULFM).

Each case is one ``mpirun --with-ft ulfm`` job of torch_fault_worker.py: every rank loops
over one ``hvd`` operation, one rank SIGKILLs itself, and every survivor's operation must
raise an error that is both :class:`mpicoll.ProcessFailedError` (naming exactly that
rank) and ``hvd.HorovodInternalError``, within test_ulfm.BOUND_S of the kill. The
survivors then idle while the stall inspector's thread polls the revoked communicators,
shrink the world, start ``hvd`` again and all-reduce there, plain and with a codec (whose
communicator must come from the runtime's new world), and exit normally: the job must end
with status 0 (no exit handler may wait on the dead rank or crash).
"""
from __future__ import annotations

from pathlib import Path

import pytest

import ompi_env
import ulfm_jobs
from test_ulfm import survivors_report

WORKER = Path(__file__).with_name("torch_fault_worker.py")
#: Seconds one job may take (torch's import on 3 ranks of a loaded 2-core machine is slow).
JOB_TIMEOUT_S = 90

#: (operation, world size, killed rank): ``-midway`` kills from a timer while 8 MiB
#: all-reduces are in flight (the data path), the others just before a call (the
#: survivors wait in the negotiation round); ``optimizer`` is DistributedOptimizer's
#: gradient all-reduce; rank 0 and a middle rank.
CASES: list[tuple[str, int, int]] = [
    ("allreduce-midway", 3, 1),
    ("optimizer", 3, 0),
]
#: More cases, run with ``ULFM_ALL_CASES=1`` (each job costs 10-30 s here).
MORE_CASES: list[tuple[str, int, int]] = [
    ("broadcast", 3, 0), ("allgather", 3, 1), ("alltoall", 3, 1), ("grouped_allreduce", 3, 2),
    ("allreduce", 4, 3),
]


def _case_id(case: tuple[str, int, int]) -> str:
    return f"{case[0]}-n{case[1]}-kill{case[2]}"


def _cases() -> list[tuple[str, int, int]]:
    return ulfm_jobs.selected(CASES, MORE_CASES)


@pytest.fixture(scope="module")
def job_outputs() -> dict:
    python = ompi_env.ompi_python(need_torch=True)
    return ulfm_jobs.run_jobs(python, {
        case: (WORKER, case[1], [case[0], str(case[2])], {}, JOB_TIMEOUT_S)
        for case in _cases()})


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", _cases(), ids=[_case_id(c) for c in _cases()])
def test_killed_rank_fails_every_survivors_torch_operation(job_outputs, case) -> None:
    op, n, victim = case
    rc, out, secs = job_outputs[case]
    tail = "\n".join(out.splitlines()[-20:])
    print(f"{_case_id(case)}: job {secs:.1f} s\n{tail}")
    if ulfm_jobs.OPEN_MPI_ABORT in out:
        pytest.xfail(f"Open MPI aborted the job twice ({ulfm_jobs.OPEN_MPI_ABORT!r})")
    problems = survivors_report(("hvd." + op, "-", n, victim), out)
    survivors = n - 1
    after = {int(f[0]): f[1:] for f in ulfm_jobs.lines(out, "AFTER")}
    for rank in sorted(set(range(n)) - {victim}):
        got = after.get(rank)
        if got is None or int(got[0]) != survivors or float(got[1]) != survivors \
                or abs(float(got[2]) - survivors) > 0.05:
            problems.append(f"rank {rank} after the shrink: {got} (want size, plain and "
                            f"int8 sums {survivors})")
    exited = {int(fields[0]) for fields in ulfm_jobs.lines(out, "EXITING")}
    missing = sorted(set(range(n)) - {victim} - exited)
    if missing:
        problems.append(f"ranks {missing} never reached their exit")
    if rc != 0:
        problems.append(f"the job ended with status {rc} (124: it hung)")
    assert not problems, f"{_case_id(case)} ({secs:.1f} s): {problems}\n{tail}"


CREATE_WORKER = Path(__file__).with_name("hvd_create_worker.py")
THREADS_WORKER = Path(__file__).with_name("group_threads_worker.py")
#: When rank 1 of ``hvd.init(comm=<ranks 0-2 of 4>)`` dies (hvd_create_worker.py): while
#: the others make the engine's side communicator, before they build a local-SGD
#: optimizer on it, before ``hvd.init``.
CREATE_CASES = ["race", "optimizer", "init"]


@pytest.fixture(scope="module")
def create_outputs() -> dict:
    """The jobs of :data:`CREATE_CASES` and (``"threads"``) group_threads_worker.py's."""
    python = ompi_env.ompi_python(need_torch=True)
    jobs = {when: (CREATE_WORKER, 4, [when], {}, JOB_TIMEOUT_S) for when in CREATE_CASES}
    jobs["threads"] = (THREADS_WORKER, 3, [], {}, JOB_TIMEOUT_S)
    return ulfm_jobs.run_jobs(python, jobs)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("when", CREATE_CASES)
def test_a_member_dead_while_communicators_are_made_is_a_process_failure(create_outputs,
                                                                          when) -> None:
    """The side communicator of an engine over some of the world's ranks is made by
    ``MPI_Comm_create_group``, which in Open MPI waits forever for a member that died:
    made through the runtime, it raises ProcessFailedError (and HorovodInternalError)
    naming the dead rank on every survivor within the bound, also once the engine has
    already failed; so does ``hvd.init``'s duplicate (not MPI's raw error). The survivors
    then exit, and the job's status says a rank failed."""
    rc, out, secs = create_outputs[when]
    tail = ulfm_jobs.show(when, create_outputs[when])
    if ulfm_jobs.OPEN_MPI_ABORT in out:
        pytest.xfail(f"Open MPI aborted the job twice ({ulfm_jobs.OPEN_MPI_ABORT!r})")
    problems = survivors_report((when, "-", 3, 1), out)   # rank 3 is not a member
    exited = {int(fields[0]) for fields in ulfm_jobs.lines(out, "EXITING")}
    if exited != {0, 2, 3}:
        problems.append(f"ranks {sorted({0, 2, 3} - exited)} never reached their exit")
    if "Segmentation fault" in out:
        problems.append("a process crashed")
    if rc in (0, 124):
        problems.append(f"the job ended with status {rc} (124: it hung; 0 hides the "
                        f"failed rank)")
    assert not problems, f"{when} ({secs:.1f} s): {problems}\n{tail}"


@pytest.mark.timeout(300)
def test_subgroups_made_under_ulfm_leave_no_thread(create_outputs) -> None:
    """Each torch.distributed subgroup's creation runs on a lane of its own under ULFM;
    ten subgroups made and destroyed leave the process with the threads it had before (it
    grew by one per subgroup on the members before the lane was closed after its
    creation)."""
    tail = ulfm_jobs.show("threads", create_outputs["threads"])
    rc, out, _ = create_outputs["threads"]
    counts = {int(f[0]): (int(f[1]), int(f[2])) for f in ulfm_jobs.lines(out, "THREADS")}
    assert rc == 0 and sorted(counts) == [0, 1, 2], tail
    assert all(after == before for before, after in counts.values()), tail
