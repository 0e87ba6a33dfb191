"""Horovod's own elastic integration script on mpicoll (issue 34), scenario by scenario.

Horovod's ``test/integration/data/elastic_torch_main.py`` (v0.28.1; not in Horovod's
sdist, so not run by CI: fetch it, nothing of it is committed) runs unchanged under
``mpirun --with-ft ulfm -n 4`` with ``horovod_shim`` on ``PYTHONPATH`` (``import
horovod.torch as hvd`` is ``mpicoll.torch``). Each scenario of Horovod's
``test/integration/elastic_common.py`` that needs no host management of horovodrun is run
as Horovod's test runs it (4 ranks, the ranks that leave at (epoch, batch) given by
``--exit-schedule``), with horovodrun's ``--reset-limit`` and ``--min-np`` as
``MPICOLL_ELASTIC_RESET_LIMIT`` and ``MPICOLL_ELASTIC_MIN_NP``; the script logs one line per
epoch, which is checked as Horovod's test checks it.

    python tests/faults/run_horovod_elastic.py <path of elastic_torch_main.py>

Prints one line per scenario (PASS/FAIL, exit status, seconds, the epoch lines' sizes and
rendezvous); exits 1 if any fails.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import ompi_env  # noqa: E402
from mpi_launcher import run_command  # noqa: E402

ROOT = HERE.parents[1]


def _expect_lines(sizes: list[int], rendezvous: list[int], start: list[int]):
    def check(rc: int, lines: list[dict]) -> bool:
        return rc == 0 and [x["size"] for x in lines] == sizes and \
            [x["rendezvous"] for x in lines] == rendezvous and \
            [x["start_rank"] for x in lines] == start
    return check


def _expect_failure(rc: int, lines: list[dict]) -> bool:
    return rc not in (0, 124) and len(lines) < 3


#: name -> (exit schedule, exit mode, extra environment, check)
SCENARIOS = {
    # test_single_rank_failure / test_fault_tolerance_without_scaling: rank 0 leaves at
    # (1, 0); Horovod's hosts of 2 slots make the survivors 2, here the 3 other ranks
    "single-rank-failure-exception": ({"(1, 0)": [0]}, "exception", {},
                                      _expect_lines([4, 3, 3], [1, 2, 2], [0, 1, 1])),
    "single-rank-failure-kill": ({"(1, 0)": [0]}, "kill", {},
                                 _expect_lines([4, 3, 3], [1, 2, 2], [0, 1, 1])),
    # test_all_ranks_failure: every rank raises at (1, 0): the job fails
    "all-ranks-failure": ({"(1, 0)": [0, 1, 2, 3]}, "exception", {}, _expect_failure),
    # test_reset_limit: two resets (here two ranks leaving); limit 1 fails, 2 succeeds
    "reset-limit-1": ({"(1, 0)": [0], "(2, 0)": [1]}, "exception",
                      {"MPICOLL_ELASTIC_RESET_LIMIT": "1"}, _expect_failure),
    "reset-limit-2": ({"(1, 0)": [0], "(2, 0)": [1]}, "exception",
                      {"MPICOLL_ELASTIC_RESET_LIMIT": "2"},
                      _expect_lines([4, 3, 2], [1, 2, 3], [0, 1, 2])),
    # test_min_hosts_timeout: min 4 ranks, one leaves: every rank raises, the job fails
    "below-min-np": ({"(1, 0)": [0]}, "exception", {"MPICOLL_ELASTIC_MIN_NP": "4"},
                     _expect_failure),
}


def main(script: Path) -> int:
    python = ompi_env.ompi_python(need_torch=True)
    shim = HERE / "horovod_shim"
    failed = 0
    for name, (schedule, mode, extra, check) in SCENARIOS.items():
        with tempfile.TemporaryDirectory() as tmp:
            log = Path(tmp) / "log.txt"
            cmd = ompi_env.mpirun_command(python, 4, [
                str(script), "--logfile", str(log), "--exit-schedule", json.dumps(schedule),
                "--exit-mode", mode])
            env = ompi_env.ompi_env(**extra)
            env["PYTHONPATH"] = f"{ROOT}:{shim}"
            rc, out, secs = run_command(cmd, env, 180)
            rc = 124 if rc is None else rc
            lines = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
        ok = check(rc, lines)
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name}: status {rc}, {secs:.1f} s, epochs logged "
              f"{len(lines)}, sizes {[x['size'] for x in lines]}, rendezvous "
              f"{[x['rendezvous'] for x in lines]}, start ranks "
              f"{[x['start_rank'] for x in lines]}", flush=True)
        if not ok:
            print("\n".join(out.splitlines()[-30:]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]).resolve()))
