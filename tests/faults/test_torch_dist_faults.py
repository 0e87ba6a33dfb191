"""Process failures in the torch.distributed backend "mpicoll" (Open MPI with ULFM).

Each case is one ``mpirun --with-ft ulfm`` job of torch_dist_fault_worker.py at n = 3:
every rank loops over one backend operation (``dist.*`` on the default group, the
backend's point-to-point, ``monitored_barrier``, object collectives, group creation), one
rank SIGKILLs itself mid-operation, and every survivor's operation must raise
:class:`mpicoll.ProcessFailedError` naming exactly that rank within test_ulfm.BOUND_S of
the kill; the next operation on the group must fail the same way at once. Survivors then
end with a bare ``raise SystemExit(status)``: the job's status must be that status (the
exit after a failure skips nothing the program asked for), and an exit handler registered
before mpicoll was imported must have run on each.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import ompi_env
import ulfm_jobs
from test_ulfm import BOUND_S, survivors_report

WORKER = Path(__file__).with_name("torch_dist_fault_worker.py")
#: Seconds one job may take (torch's import on 3 ranks of a loaded 2-core machine is slow).
JOB_TIMEOUT_S = 90

#: (operation, killed rank, the survivors' exit status). By default one job: rank 0 (the
#: store's host) killed while rank 1 waits for a message from rank 2, which waits in a
#: barrier on the group's thread (survivors blocked on survivors: the point-to-point
#: failure watch, the revocation, MPI's own collective); the survivors end with a bare
#: ``SystemExit(3)``. And a member killed while a subgroup of two is being made: Open MPI
#: leaves the other member's ``MPI_Comm_create_group`` waiting for it, and that process
#: must end without ``MPI_Finalize``, which crashed under the waiting thread.
CASES: list[tuple[str, int, int]] = [("blocked", 0, 3), ("new_subgroup", 1, 0)]
#: Every operation kind, with ``ULFM_ALL_CASES=1`` (each job 5-25 s here, 50 s at load 15).
MORE_CASES: list[tuple[str, int, int]] = (
    [(op, 1, 0) for op in ("allreduce", "broadcast", "reduce", "allgather",
                           "reduce_scatter", "gather", "alltoall", "alltoall_single",
                           "barrier", "monitored_barrier", "sendrecv", "batch_isend_irecv",
                           "object", "new_group", "split_group", "async_future")]
    + [(op, 0, 0) for op in ("gather", "broadcast", "monitored_barrier", "object",
                             "new_group")]
    + [("scatter", 0, 0), ("recv_live", 1, 0), ("recv_live", 0, 0), ("blocked", 1, 0),
       ("sendrecv", 2, 5)])


#: What a process whose thread was left in an MPI call prints as it ends without
#: ``MPI_Finalize`` (mpicoll.runtime.exit).
FINALIZE_SKIPPED = "mpicoll: MPI_Finalize skipped: thread(s) mpicoll-create-"


def _case_id(case: tuple[str, int, int]) -> str:
    return f"{case[0]}-kill{case[1]}-exit{case[2]}"


def _cases() -> list[tuple[str, int, int]]:
    return ulfm_jobs.selected(CASES, MORE_CASES)


@pytest.fixture(scope="module")
def job_outputs() -> dict:
    python = ompi_env.ompi_python(need_torch=True)
    return ulfm_jobs.run_jobs(python, {
        case: (WORKER, 3, [case[0], str(case[1]), str(case[2])], {}, JOB_TIMEOUT_S)
        for case in _cases()})


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", _cases(), ids=[_case_id(c) for c in _cases()])
def test_killed_rank_fails_every_survivors_backend_operation(job_outputs, case) -> None:
    op, victim, status = case
    n = 3
    rc, out, secs = job_outputs[case]
    tail = "\n".join(out.splitlines()[-20:])
    print(f"{_case_id(case)}: job {secs:.1f} s\n{tail}")
    if ulfm_jobs.OPEN_MPI_ABORT in out:
        pytest.xfail(f"Open MPI aborted the job twice ({ulfm_jobs.OPEN_MPI_ABORT!r})")
    if op in ("new_group", "split_group") and ulfm_jobs.OPEN_MPI_CREATE_CRASH in out:
        pytest.xfail("Open MPI crashed making a communicator while a member died "
                     f"({ulfm_jobs.OPEN_MPI_CREATE_CRASH})")
    problems = survivors_report(("dist." + op, "-", n, victim), out)
    survivors = set(range(n)) - {victim}
    after = {int(f[0]): f[1:] for f in ulfm_jobs.lines(out, "AFTER")}
    for rank in sorted(survivors):
        got = after.get(rank)
        if got is None:
            problems.append(f"rank {rank}: never tried the group again")
        elif got[0] != "pfe" or float(got[1]) > BOUND_S:
            problems.append(f"rank {rank}: the next operation on the failed group: "
                            f"{' '.join(got)}")
    for tag in ("EXITING", "ATEXIT"):
        seen = {int(fields[0]) for fields in ulfm_jobs.lines(out, tag) if fields}
        missing = len(survivors - seen)
        if tag == "ATEXIT" and op == "new_subgroup":   # a member ends without finalizing
            missing -= out.count(FINALIZE_SKIPPED)
        if missing > 0:
            problems.append(f"ranks {sorted(survivors - seen)}: no {tag} line")
    if "Segmentation fault" in out:
        problems.append("a process crashed")
    if rc != status:
        problems.append(f"the job ended with status {rc}, not the survivors' {status} "
                        f"(124: it hung)")
    assert not problems, f"{_case_id(case)} ({secs:.1f} s): {problems}\n{tail}"


#: (operation, the rank that skips the all-reduce): a group broken by a timeout or an
#: abort, with nobody dead.
BROKEN_CASES = [("timeout", 1), ("abort", 1)]


@pytest.fixture(scope="module")
def broken_outputs() -> dict:
    python = ompi_env.ompi_python(need_torch=True)
    return ulfm_jobs.run_jobs(python, {
        case: (WORKER, 2, [case[0], str(case[1])], {}, JOB_TIMEOUT_S) for case in BROKEN_CASES})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", BROKEN_CASES, ids=[c[0] for c in BROKEN_CASES])
def test_timeout_or_abort_revokes_so_the_call_in_flight_ends(broken_outputs, case) -> None:
    """Under ULFM an expired ``Work.wait(timeout)`` or ``abort()`` raises at once and
    revokes the group's communicators, so the all-reduce the other rank never joined ends
    (its lane is free again) and the job ends with status 0."""
    op, skipper = case
    rc, out, secs = broken_outputs[case]
    tail = "\n".join(out.splitlines()[-20:])
    got = ulfm_jobs.lines(out, "BROKEN")
    assert len(got) == 1, f"{op} ({secs:.1f} s): {tail}"
    _, error, raised, free = got[0]
    assert error == ("CollectiveTimeoutError" if op == "timeout" else "CollectiveError"), tail
    assert 0.9 < float(raised) < BOUND_S and float(free) < float(raised) + BOUND_S, tail
    assert rc == 0, f"{op}: the job ended with status {rc} (124: it hung)\n{tail}"

