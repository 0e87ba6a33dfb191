"""A rank whose elastic function ends early is a lost rank (issue 34), under ``mpirun
--with-ft ulfm``: ``elastic_end_worker.py``, one job per case.

- ``return`` / ``exit`` (3 ranks; ``exit`` with ``ULFM_ALL_CASES=1``): the last rank's function returns (``sys.exit(0)``) at
  step 5 of 20 while the others train on. It must leave (the others' stall inspector asks
  it to), and the 2 others finish at size 2 with exactly ``5 * 3 + 15 * 2`` in their count
  of ranks per step (the interrupted step redone at size 2), within seconds, not at the
  end bound (300 s) nor the job's timeout. On today's code before this change the
  inspector aborted the job (status 1).
- ``hvd``: the same through ``hvd.elastic``, where the others wait inside the Horovod
  engine's negotiation (not a collective the inspector sees); ``ddp``: DDP on the
  "mpicoll" process group, where they wait in the group's agreement step (the inspector
  did not see it before this change: the job hung until its timeout).
- ``again``: the same in a second run of the elastic function after a first that every
  rank ended (the end agreement runs once per run).
- ``bound``: with the stall inspector off, the early rank leaves after
  ``MPICOLL_ELASTIC_END_WAIT_S=2`` seconds.
- ``slow``: rank 0 works 3 s alone after the last collective: nobody leaves, all 3 end at
  size 3 (a rank that only ends later is not lost).
- ``fail`` (4 ranks): ranks 2 and 3 have ended and wait when rank 1 dies during extra steps
  that ranks 0 and 1 run alone: the end agreement tells 2 and 3 to reset with rank 0, and
  the 3 survivors end at size 3.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import ompi_env
import ulfm_jobs

WORKER = Path(__file__).parent / "elastic_end_worker.py"
STEPS, STOP = 20, 5
JOB_TIMEOUT_S = 120
#: From the early end to the survivors' first step after the reset: the inspector's grace
#: (1 s) and poll, the leave and ULFM's detection; far below the 300 s bound.
LEAVE_BOUND_S = 10.0

#: name -> (mode, world size, extra environment)
CASES = {
    "return": ("return", 3, {}),
    "hvd": ("hvd", 3, {}),
    "ddp": ("ddp", 3, {}),
    "again": ("again", 3, {}),
    "bound": ("return", 3, {"MPICOLL_STALL_WARN_SECONDS": "0",
                            "MPICOLL_ELASTIC_END_WAIT_S": "2"}),
    "slow": ("slow", 3, {}),
    "fail": ("fail", 4, {}),
}
#: Also with ``ULFM_ALL_CASES=1`` (``sys.exit(0)`` takes the path ``return`` takes).
MORE = {"exit": ("exit", 3, {})}
if ulfm_jobs.ALL_CASES:
    CASES.update(MORE)


@pytest.fixture(scope="module")
def outputs() -> dict:
    python = ompi_env.ompi_python(need_torch=True)
    jobs = {name: (WORKER, n, [mode, str(STEPS), str(STOP)], env, JOB_TIMEOUT_S)
            for name, (mode, n, env) in CASES.items()}
    return ulfm_jobs.run_jobs(python, jobs)


def _finished(outputs: dict, name: str) -> tuple[str, dict[int, list[str]]]:
    rc, out, _ = outputs[name]
    tail = ulfm_jobs.show(name, outputs[name])
    assert rc == 0, f"{name}: status {rc}\n{tail}"
    return tail, ulfm_jobs.done(out)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["return", "hvd", "ddp", "again", "bound"]
                         + (["exit"] if ulfm_jobs.ALL_CASES else []))
def test_a_rank_that_ends_early_leaves_and_the_others_finish(outputs, name) -> None:
    tail, done = _finished(outputs, name)
    out = outputs[name][1]
    assert sorted(done) == [0, 1], f"only the two others return from run\n{tail}"
    total = STOP * 3 + (STEPS - STOP) * 2
    for rank, (size, step, got, result, resets) in done.items():
        assert (size, step, got, result, resets) == ("2", str(STEPS), str(total), "done",
                                                     "[2]"), f"rank {rank}\n{tail}"
    early = float(ulfm_jobs.lines(out, "EARLY")[0][1])
    first = [float(f[0]) for f in ulfm_jobs.lines(out, "FIRST")]
    assert len(first) == 2, tail
    bound = 2.0 + LEAVE_BOUND_S if name == "bound" else LEAVE_BOUND_S
    assert max(first) - early < bound, f"{max(first) - early:.1f} s to go on\n{tail}"
    if name == "bound":
        assert "MPICOLL_ELASTIC_END_WAIT_S" in out, tail
    else:
        assert "asking it to leave the job as a lost rank" in out, tail
    assert "ERRONEOUS" not in out, f"an agreement left behind\n{tail}"


@pytest.mark.timeout(600)
def test_a_rank_that_only_ends_later_is_waited_for(outputs) -> None:
    tail, done = _finished(outputs, "slow")
    assert sorted(done) == [0, 1, 2], tail
    assert {tuple(f) for f in done.values()} == {("3", str(STEPS), str(STEPS * 3), "done",
                                                  "[]")}, tail
    assert "lost rank" not in outputs["slow"][1], tail


@pytest.mark.timeout(600)
def test_a_failure_while_ranks_wait_at_the_end_resets_them_too(outputs) -> None:
    tail, done = _finished(outputs, "fail")
    assert sorted(done) == [0, 2, 3], tail
    assert {tuple(f) for f in done.values()} == {("3", str(STEPS), str(STEPS * 4), "done",
                                                  "[3]")}, tail
    assert "before every rank's elastic function had ended" in outputs["fail"][1], tail
