"""DDP and FSDP2 over "mpicoll" under ULFM (issue 34): the process group reconfigures in
place, an FSDP2 model is sharded again over the survivors, a rank that raises is a lost
rank, ``dist.shrink_group`` works on MPI.

Each case is one ``mpirun --with-ft ulfm`` job of ddp_elastic_worker.py or
fsdp_elastic_worker.py:

- ``ddp`` (4 ranks, no ``hvd.init()``): DDP built once, trained 60 steps inside
  ``hvd.elastic.run``; the last rank is SIGKILLed at step 20. The 3 survivors end at size
  3 with bitwise identical parameters, ``dist.all_reduce`` of a one sums to 3, and the
  parameters are within 1e-6 of a float64 reference restarted at size 3 from the step-20
  commit, while a reference that divides by 4 (a reducer that kept the old size) is far
  off (so the check can fail);
  Then the last of the 3 is killed too: ``dist.shrink_group(exc.failed_ranks)`` after a
  caught ``ProcessFailedError`` gives a default group of the 2 others whose all-reduce
  sums over 2 and on which a new DDP module averages its gradients;
- ``fsdp-backward`` (4 ranks): an FSDP2 model (SGD with momentum) built once over a 1-D
  mesh, the last rank killed inside its backward pass at step 20 of 60 (the survivors
  fail in FSDP's backward collectives): the 3 survivors' mesh is ``[0, 1, 2]``, their
  full parameters are bitwise identical and within 1e-6 of the reference restarted at 3
  ranks from the step-20 commit (the one dividing by 4 is far off); with
  ``ULFM_ALL_CASES=1`` also ``fsdp``, the rank killed before its step;
- ``mesh2d`` (4 ranks): a 2 x 2 DeviceMesh in the state; after the last rank's death the
  3 survivors cannot fill it: ``ValueError`` on every survivor, status non-zero;
- ``reset-limit``: ``MPICOLL_ELASTIC_RESET_LIMIT=1``; rank 1 raises at step 20: it prints
  its traceback and leaves, the two others shrink and train on to step 40 at size 2, where
  rank 1 (another process) raises too: that second reset raises ``ResetLimitError`` on the
  survivor (status non-zero);
- with ``ULFM_ALL_CASES=1`` also ``raise`` (rank 1 raises at step 20, the others finish
  at size 2 as in ``ddp``, status 0), ``raise-all`` (every rank raises at step 20: the job
  ends with status 1) and ``below-min-np`` (``MPICOLL_ELASTIC_MIN_NP=3`` and a rank
  raising: ``TooFewRanksError`` on every survivor).

Four jobs in CI (a torch job costs 13-15 s of the 2-core machine).
"""
from __future__ import annotations

from pathlib import Path

import pytest

import ompi_env
import ulfm_jobs

WORKER = Path(__file__).parent / "ddp_elastic_worker.py"
FSDP_WORKER = Path(__file__).parent / "fsdp_elastic_worker.py"
JOB_TIMEOUT_S = 120

#: name -> (world size, worker mode, extra environment)
JOBS = {"ddp": (4, "ddp", {}),
        "reset-limit": (3, "raise-twice", {"MPICOLL_ELASTIC_RESET_LIMIT": "1"}),
        "fsdp-backward": (4, "fsdp-backward", {}), "mesh2d": (4, "mesh2d", {})}
MORE_JOBS = {"fsdp": (4, "fsdp", {}), "raise": (3, "raise", {}), "raise-all": (3, "raise-all", {}),
             "below-min-np": (3, "raise", {"MPICOLL_ELASTIC_MIN_NP": "3"})}
SELECTED = dict(ulfm_jobs.selected(list(JOBS.items()), list(MORE_JOBS.items())))


@pytest.fixture(scope="module")
def outputs() -> dict:
    python = ompi_env.ompi_python(need_torch=True)
    return ulfm_jobs.run_jobs(python, {
        name: (FSDP_WORKER if mode in ("fsdp", "fsdp-backward", "mesh2d") else WORKER, n,
               [mode], env, JOB_TIMEOUT_S)
        for name, (n, mode, env) in SELECTED.items()})


def _result(outputs: dict, name: str) -> tuple[int, str, str]:
    rc, out, _ = outputs[name]
    return rc, out, ulfm_jobs.show(name, outputs[name], last=30)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [n for n in ("ddp", "raise") if n in SELECTED])
def test_ddp_goes_on_with_the_survivors(outputs, name) -> None:
    rc, out, tail = _result(outputs, name)
    assert rc == 0, tail
    left = str(SELECTED[name][0] - 1)
    done = ulfm_jobs.done(out)
    assert sorted(done) == list(range(int(left))), tail        # ranks of the new world
    # dist.get_world_size(), one digest on every rank, all_reduce of ones, the commit's step
    assert {tuple(f) for f in done.values()} == {(left, done[0][1], left, "20")}, tail
    (ref, stale), = [(float(a), float(b)) for a, b in ulfm_jobs.lines(out, "REFDIFF")]
    assert ref < 1e-6 and stale > 1e-3, tail
    if name == "raise":
        assert "rank 1 of 3 raised RuntimeError" in out and "rank 1 raises at step 20" in out


@pytest.mark.timeout(900)
def test_shrink_group_after_a_failure(outputs) -> None:
    rc, out, tail = _result(outputs, "ddp")
    assert rc == 0, tail
    shrunk = {int(f[0]): f[1:] for f in ulfm_jobs.lines(out, "SHRUNK")}
    assert sorted(shrunk) == [0, 1], tail
    # size 2, rank 2 failed, all-reduce of rank+1 sums 1+2, new default group, DDP averages
    assert all(f == ["2", "[2]", "3", "True", "True"] for f in shrunk.values()), tail


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [n for n in ("fsdp-backward", "fsdp") if n in SELECTED])
def test_fsdp2_is_sharded_again_over_the_survivors(outputs, name) -> None:
    rc, out, tail = _result(outputs, name)
    assert rc == 0, tail
    done = ulfm_jobs.done(out)
    assert sorted(done) == [0, 1, 2], tail
    # size 3, the renumbered mesh, one digest of the full parameters, the commit's step
    assert {" ".join(f[1:-2]) for f in done.values()} == {"[0, 1, 2]"}, tail
    assert {(f[0], f[-2], f[-1]) for f in done.values()} == {("3", done[0][-2], "20")}, tail
    (ref, stale), = [(float(a), float(b)) for a, b in ulfm_jobs.lines(out, "REFDIFF")]
    assert ref < 1e-6 and stale > 1e-3, tail


#: job -> what its output must say
ERRORS = {"raise-all": "rank 2 raises at step 20", "reset-limit": "ResetLimitError",
          "below-min-np": "TooFewRanksError",
          "mesh2d": "cannot be filled by the 3 ranks of the shrunk world"}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [name for name in ERRORS if name in SELECTED])
def test_the_job_ends_with_an_error_status(outputs, name) -> None:
    error = ERRORS[name]
    rc, out, tail = _result(outputs, name)
    assert rc not in (0, 124), tail
    assert error in out, tail
    assert not ulfm_jobs.lines(out, "DONE"), tail
    if name == "mesh2d":           # every survivor raised
        assert sorted(int(f[0]) for f in ulfm_jobs.lines(out, "MESHERROR")) == [0, 1, 2], tail
    if name == "reset-limit":      # the first rank that raised left, the others went on
        assert "rank 1 of 3 raised RuntimeError" in out, tail
        assert "world shrank from 3 to 2" in out and "rank 1 raises at step 40" in out, tail
