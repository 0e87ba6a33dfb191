"""Submit every script in jobs/ to a real one-node Slurm and check what each job did.

A module-scoped fixture brings up a private one-node cluster with ``.ci/slurm/start.sh``
(installing Debian's ``slurm-wlm`` on first use, about 90 s; 1 s when installed) and stops
it afterwards by PID with ``.ci/slurm/stop.sh`` (only if this module started it). Every job
is small (2-4 tasks, tiny sizes) and runs alone, one after another: MPICH ranks poll while
they wait, so jobs sharing the two cores would only slow each other down.

Checked for every job: its exit code (read from ``scontrol show job``, polled every 0.5 s
by ``.ci/slurm/wait.sh``), that its MPI world has ``SLURM_NTASKS`` ranks, and what its
output says (benchmark results validated, hierarchical layout with one leader per node,
parameter-server accuracy, training resumed from its checkpoint after ``scontrol requeue``
and after the pre-time-limit signal). A job that runs with the wrong PMI must fail the
world-size check.

Skips (with the reason) only where Slurm cannot be installed: not Linux, not root with
Slurm missing, no apt-get, or apt failing. ``MPICOLL_SLURM_TESTS=0`` skips on purpose.
"""
from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]
JOBS = ROOT / "jobs"
CI = ROOT / ".ci" / "slurm"
BASE = Path(os.environ.get("MPICOLL_SLURM_DIR", "/tmp/mpicoll-slurm"))
TRAIN_PY = ROOT / "examples" / "train.py"
PS_PY = ROOT / "examples" / "ps_train.py"

# First test pays for the cluster (and, on a fresh machine, for apt-get install).
pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="Slurm CI cluster needs Linux")]


def _alive(name: str) -> bool:
    try:
        pid = int((BASE / f"{name}.pid").read_text())
        return Path(f"/proc/{pid}/comm").read_text().strip() == name
    except (OSError, ValueError):
        return False


class Slurm:
    """The running CI cluster: submit jobs, wait for them, read their logs."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.jobs: list[str] = []  # everything submitted, cancelled at the end
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "MPICOLL_",
                                    "PMI_", "PMIX_", "HYDRA_", "OMPI_", "PYTEST_"))}
        env["SLURM_CONF"] = str(BASE / "slurm.conf")
        env["PATH"] = "/usr/bin:/usr/sbin:" + env.get("PATH", "")
        env["MPICOLL_ROOT"] = str(ROOT)
        if sys.prefix != sys.base_prefix:  # the venv running these tests
            env["MPICOLL_VENV"] = sys.prefix
        else:
            env["MPICOLL_VENV"] = "none"
            env["MPICOLL_PYTHON"] = sys.executable
        self.env = env

    def run(self, *cmd: str, env: dict | None = None, timeout: float = 30,
            check: bool = True) -> subprocess.CompletedProcess:
        """Run a Slurm client command (or a jobs/ submit script) in the checkout's root."""
        proc = subprocess.run(cmd, cwd=ROOT, env={**self.env, **(env or {})}, text=True,
                              capture_output=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n"
                                 f"{proc.stdout}\n{proc.stderr}")
        return proc

    def submit(self, script: str, *sbatch_args: str, env: dict | None = None,
               args: tuple[str, ...] = ()) -> tuple[str, Path]:
        """sbatch jobs/SCRIPT with SBATCH_ARGS (overriding its header); (job id, log)."""
        name = Path(script).stem
        log = self.logdir / f"{name}-%j.out"
        out = self.run("sbatch", "--parsable", f"--output={log}", *sbatch_args,
                       str(JOBS / script), *args, env=env).stdout.strip()
        job = out.split(";")[0]
        self.jobs.append(job)
        return job, self.logdir / f"{name}-{job}.out"

    def wait(self, job: str, timeout: float = 240) -> int:
        """Wait for JOB (all array tasks) to leave the queue; its exit code."""
        proc = self.run(str(CI / "wait.sh"), job, str(int(timeout)),
                        timeout=timeout + 30, check=False)
        if proc.returncode == 124:
            raise AssertionError(f"job {job} did not finish in {timeout:.0f} s "
                                 f"(cancelled):\n{self.job_info(job)}")
        return proc.returncode

    def job_info(self, job: str) -> str:
        return self.run("scontrol", "show", "job", job, check=False).stdout

    def restarts(self, job: str) -> int:
        m = re.search(r"\bRestarts=(\d+)", self.job_info(job))
        return int(m.group(1)) if m else -1

    def start_now(self, job: str, restarts: int, deadline: float = 60) -> None:
        """Once JOB has been requeued RESTARTS times, lift the ~2 min BeginTime hold Slurm
        puts on a requeued job (CI has no time to wait).

        Not at once: slurmd revokes the old run's credential with a one-second timestamp,
        and a run started within that second is killed ("Job credential revoked").
        """
        end = time.monotonic() + deadline
        seen = None
        while time.monotonic() < end:
            if seen is None and self.restarts(job) >= restarts:
                seen = time.monotonic()
            if seen is not None:
                state = self.run("squeue", "-h", "-j", job, "-o", "%T %r",
                                 check=False).stdout.split()
                if state == ["PENDING", "BeginTime"]:
                    if time.monotonic() - seen >= 2.0:
                        self.run("scontrol", "update", f"JobId={job}", "StartTime=now",
                                 check=False)
                elif not state or state[0] == "RUNNING" or state[0] == "PENDING":
                    return  # running again, about to (other reason), or already gone
                # else COMPLETING / REQUEUE_*: the old run is still being torn down
            time.sleep(0.3)
        raise AssertionError(f"job {job} was not requeued {restarts} time(s) and started "
                             f"again in {deadline:.0f} s:\n{self.job_info(job)}")


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else f"<no log {path}>"


def _assert_ok(slurm: Slurm, job: str, log: Path, rc: int) -> str:
    text = _read(log)
    assert rc == 0, f"job {job} exited {rc}:\n{text}\n{slurm.job_info(job)}"
    return text


def _assert_world(text: str, n: int) -> None:
    assert re.search(rf"^world ok: size {n} == expected {n},", text, re.M), \
        f"no 'world ok: size {n}' line:\n{text}"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    """The one-node CI cluster, started for this module and stopped after it."""
    if os.environ.get("MPICOLL_SLURM_TESTS", "1") == "0":
        pytest.skip("MPICOLL_SLURM_TESTS=0")
    was_up = _alive("slurmctld") and _alive("slurmd")
    t0 = time.monotonic()
    try:
        proc = subprocess.run([str(CI / "start.sh")], text=True, capture_output=True,
                              timeout=900)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f".ci/slurm/start.sh timed out after 900 s:\n{e.stderr}")
    if proc.returncode == 77:
        pytest.skip("Slurm cannot be installed here: "
                    + (proc.stderr.strip().splitlines() or ["?"])[-1])
    if proc.returncode != 0:
        pytest.fail(f".ci/slurm/start.sh failed ({proc.returncode}):\n{proc.stderr}")
    print(f"Slurm up in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    cluster = Slurm(tmp_path_factory.mktemp("slurm-logs"))
    try:
        yield cluster
    finally:
        if cluster.jobs:  # a failed test may have left its job running
            cluster.run("scancel", *cluster.jobs, check=False)
        if not was_up:
            subprocess.run([str(CI / "stop.sh")], timeout=120, check=False)


#: Every submittable script in jobs/ and the test(s) below that submit it.
COVERED = {
    "train.sbatch": "test_train_job_with_mpirun, test_train_job_requeued_resumes_from_checkpoint",
    "ps.sbatch": "test_parameter_server_job, test_wrong_pmi_fails_the_world_check",
    "hierarchical.sbatch": "test_hierarchical_job",
    "elastic.sbatch": "test_elastic_job_relaunches_after_a_rank_dies "
                      "(a lost node: tests/cluster/test_cluster_elastic.py, opt-in)",
    "bench_submit.sh": "test_bench_sweep_array_and_collect",
    "bench_sweep.sbatch": "test_bench_sweep_array_and_collect (via bench_submit.sh)",
    "bench_collect.sbatch": "test_bench_sweep_array_and_collect (via bench_submit.sh)",
}


def test_every_job_script_is_submitted_by_a_test() -> None:
    """A new script in jobs/ needs a test here that submits it (common.sh is sourced)."""
    scripts = {p.name for p in JOBS.glob("*.sbatch")} | {p.name for p in JOBS.glob("*.sh")}
    assert scripts - {"common.sh"} == set(COVERED), \
        f"untested: {sorted(scripts - {'common.sh'} - set(COVERED))}, " \
        f"gone: {sorted(set(COVERED) - scripts)}"


def test_wrong_pmi_fails_the_world_check(slurm: Slurm, tmp_path: Path) -> None:
    """srun without PMI-2 gives MPICH singletons: the job must fail, saying why."""
    job, log = slurm.submit("ps.sbatch", "--ntasks=2", env={"MPICOLL_SRUN_MPI": "none",
                                                            "PS_OUT": str(tmp_path)})
    rc = slurm.wait(job, 120)
    text = _read(log)
    assert rc != 0, f"job with the wrong PMI succeeded:\n{text}"
    assert "world WRONG: task" in text and "sees MPI world size 1, expected 2" in text, text
    assert "final:" not in text, "training ran although the world check failed"


@pytest.mark.skipif(not PS_PY.exists(), reason="examples/ps_train.py not there yet")
def test_parameter_server_job(slurm: Slurm, tmp_path: Path) -> None:
    """Two servers (tasks 0-1) and two workers train to a good accuracy; metrics written."""
    # the script's own layout (4 tasks), as a user would submit it
    job, log = slurm.submit("ps.sbatch",
                            env={"PS_SERVERS": "2", "PS_STEPS": "150", "PS_OUT": str(tmp_path)})
    text = _assert_ok(slurm, job, log, slurm.wait(job, 180))
    _assert_world(text, 4)
    assert "2 server(s) (ranks 0-1), 2 worker(s)" in text, text
    m = re.search(r"^final: test loss [\d.]+\s+accuracy ([\d.]+)\s+\(bsp, 2 server\(s\), "
                  r"2 workers", text, re.M)
    assert m, f"no final line:\n{text}"
    assert float(m.group(1)) >= 0.6, f"accuracy {m.group(1)} too low:\n{text}"
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["final"][1] == pytest.approx(float(m.group(1)), abs=1e-3)
    assert (tmp_path / "checkpoint").exists()


def test_hierarchical_job(slurm: Slurm) -> None:
    """On one real node the job emulates 2 nodes; one leader per node; results exact."""
    job, log = slurm.submit(
        "hierarchical.sbatch", "--nodes=1", "--ntasks-per-node=4",
        env={"HIER_COUNTS": "0,1,7,1000,65537",
             "HIER_BENCH_ARGS": "-m 8:1K -i 3 -x 1 --iterations-large 2 -c "
                                "--algo hierarchical --memcpy-bytes 0"})
    text = _assert_ok(slurm, job, log, slurm.wait(job, 180))
    _assert_world(text, 4)
    assert "one real node: emulating 2 nodes of MPICOLL_RANKS_PER_NODE=2 ranks" in text, text
    assert re.search(r"^topology: 2 node\(s\) emulated .*ranks per node \[2, 2\], "
                     r"leaders \[0, 2\]", text, re.M), text
    assert len(re.findall(r"^count\s+\d+: hierarchical", text, re.M)) == 5, text
    assert "hierarchical allreduce: all results correct" in text, text
    assert "Ranks per node: 2" in text, text  # the benchmark saw the same layout
    assert re.search(r"^1024\s+hierarchical\s.*ok$", text, re.M), text
    assert "# validation: all results correct" in text, text


def test_bench_sweep_array_and_collect(slurm: Slurm, tmp_path: Path) -> None:
    """2 collectives x world sizes 2 and 3 as a job array; the dependent job collects."""
    results = tmp_path / "results"
    proc = slurm.run(str(JOBS / "bench_submit.sh"), env={
        "BENCH_COLLECTIVES": "allreduce allgather", "BENCH_WORLD_SIZES": "2 3",
        "BENCH_ARGS": "-m 8:1K -i 3 -x 1 --iterations-large 2 -c --algo ring "
                      "--memcpy-bytes 0",
        "BENCH_RESULTS": str(results), "BENCH_LOG_DIR": str(slurm.logdir)})
    ids = dict(line.split(" ", 1) for line in proc.stdout.strip().splitlines())
    sweep, collect = ids["sweep"], ids["collect"]
    slurm.jobs += [sweep, collect]
    rc = slurm.wait(sweep, 240)
    logs = sorted(slurm.logdir.glob(f"mpicoll-bench-{sweep}_*.out"))
    text = "\n".join(_read(p) for p in logs)
    assert rc == 0, f"sweep {sweep} exited {rc}:\n{text}\n{slurm.job_info(sweep)}"
    assert len(logs) == 4, f"expected 4 array-task logs, got {logs}"
    for n in (2, 3):
        _assert_world(text, n)
    for collective in ("allreduce", "allgather"):
        for n in (2, 3):
            data = json.loads((results / f"{collective}-n{n}.json").read_text())
            assert data["meta"]["world_size"] == n
            rows = data["results"]
            assert {r["algorithm"] for r in rows} >= {"ring", "mpi"}, rows
            # the bytes measured: whole float32 elements, and for allgather whole blocks
            # per rank (at n = 3, 8 and 16 B both measure 12 B: one row)
            sizes = {8, 16, 32, 64, 128, 256, 512, 1024}
            if (collective, n) == ("allgather", 3):
                sizes = {12, 24, 60, 120, 252, 504, 1020}
            assert {r["size"] for r in rows} == sizes
            assert all(r["validated"] for r in rows), rows
    crc = slurm.wait(collect, 120)
    ctext = _read(slurm.logdir / f"mpicoll-bench-collect-{collect}.out")
    assert crc == 0, f"collect {collect} exited {crc}:\n{ctext}\n{slurm.job_info(collect)}"
    assert "all validated rows correct" in ctext, ctext
    table = (results / "summary.md").read_text()
    for heading in ("## allreduce", "## allgather", "### 2 ranks", "### 3 ranks"):
        assert heading in table, table
    assert table.count("| 1 KiB |") == 3, table   # (allgather at n = 3: 1020 B)
    rows = list(csv.DictReader((results / "summary.csv").open()))
    assert len(rows) == (8 + 8 + 8 + 7) * 2, rows  # sizes of each (collective, n) x {mpi, ring}
    assert {(r["collective"], r["world_size"]) for r in rows} == {
        (c, n) for c in ("allreduce", "allgather") for n in ("2", "3")}
    for collective in ("allreduce", "allgather"):
        png = results / f"{collective}-busbw.png"
        assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


# ----------------------------------------------------------------------- training
# Enough epochs (0.1-0.4 s each here) that training cannot end before a requeue lands.
TRAIN_EPOCHS = 30
EPOCH_LINE = re.compile(r"^epoch\s+(\d+)/(\d+)\s+loss ([\d.]+)\s+test accuracy ([\d.]+)", re.M)
RUN_HEADER = re.compile(r"^== mpicoll-train \d+ restart (\d+) ", re.M)


def _runs(text: str) -> list[str]:
    """The log of a job split at each run's header (append mode keeps them all)."""
    starts = [m.start() for m in RUN_HEADER.finditer(text)]
    return [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])]


def _epochs(text: str) -> dict[int, tuple[str, str]]:
    """{epoch: (loss, accuracy)} as printed (strings: compared exactly)."""
    return {int(m.group(1)): (m.group(3), m.group(4)) for m in EPOCH_LINE.finditer(text)}


def _final_accuracy(text: str) -> float:
    m = re.search(r"^final test accuracy: ([\d.]+) \(2 ranks", text, re.M)
    assert m, f"no final accuracy line:\n{text}"
    return float(m.group(1))


def _wait_for(what: str, cond, job: str, slurm: Slurm, log: Path, timeout: float = 120) -> None:
    """Poll COND until true; fail at once (with the log) if JOB ends first."""
    end = time.monotonic() + timeout
    polls = 0
    while not cond():
        polls += 1
        if time.monotonic() > end or (polls % 5 == 0 and not slurm.run(
                "squeue", "-h", "-j", job, "-o", "%T", check=False).stdout.strip()):
            raise AssertionError(f"job {job} ended or timed out before {what}:\n{_read(log)}"
                                 f"\n{slurm.job_info(job)}")
        time.sleep(0.2)


needs_train = pytest.mark.skipif(not TRAIN_PY.exists(), reason="examples/train.py not there yet")


@pytest.fixture(scope="module")
def plain_training(slurm: Slurm, tmp_path_factory: pytest.TempPathFactory) -> str:
    """train.sbatch launched with mpirun inside the allocation, never interrupted."""
    ckpt = tmp_path_factory.mktemp("train-plain")
    job, log = slurm.submit("train.sbatch", "--ntasks=2", env={
        "MPICOLL_LAUNCHER": "mpirun", "TRAIN_EPOCHS": str(TRAIN_EPOCHS),
        "TRAIN_CHECKPOINT_DIR": str(ckpt)})
    return _assert_ok(slurm, job, log, slurm.wait(job, 240))


@needs_train
def test_train_job_with_mpirun(plain_training: str) -> None:
    """mpirun inside the allocation: right world, every epoch, accuracy reached."""
    text = plain_training
    assert "launcher mpirun" in text, text
    _assert_world(text, 2)
    assert "starting fresh" in text, text
    assert sorted(_epochs(text)) == list(range(1, TRAIN_EPOCHS + 1)), text
    assert _final_accuracy(text) >= 0.9, text
    assert "training finished with exit status 0" in text, text


@needs_train
def test_train_job_requeued_resumes_from_checkpoint(slurm: Slurm, tmp_path: Path,
                                                    plain_training: str) -> None:
    """srun launch; `scontrol requeue` after the first checkpoint, then the pre-time-limit
    signal (USR1 to the batch script, whose trap requeues) after a later one: each run
    resumes from the last checkpoint, and the whole trajectory equals the uninterrupted
    run's (same losses and accuracies, epoch by epoch), so nothing was lost."""
    ckpt = tmp_path / "ckpt"
    checkpoint = ckpt / "checkpoint.pt"
    job, log = slurm.submit("train.sbatch", "--ntasks=2", env={
        "TRAIN_EPOCHS": str(TRAIN_EPOCHS), "TRAIN_CHECKPOINT_DIR": str(ckpt)})
    # 1. scontrol requeue once the first checkpoint is there
    _wait_for("the first checkpoint", checkpoint.exists, job, slurm, log)
    slurm.run("scontrol", "requeue", job)
    slurm.start_now(job, restarts=1)
    # 2. once the second run has resumed and checkpointed an epoch of its own: the signal
    #    Slurm sends before the time limit (--signal=B:USR1@180), sent now
    def second_run_checkpointed() -> bool:
        runs = _runs(_read(log))
        return len(runs) >= 2 and len(_epochs(runs[1])) >= 1
    _wait_for("the second run's first epoch", second_run_checkpointed, job, slurm, log)
    time.sleep(0.5)  # rank 0 saves right after printing
    slurm.run("scancel", "--batch", "--signal=USR1", job)
    slurm.start_now(job, restarts=2)
    text = _assert_ok(slurm, job, log, slurm.wait(job, 240))

    runs = _runs(text)
    assert [RUN_HEADER.search(r).group(1) for r in runs] == ["0", "1", "2"], text
    assert "starting fresh" in runs[0] and "DUE TO JOB REQUEUE" in runs[0], runs[0]
    assert "USR1 (time limit near): requeueing job" in runs[1], runs[1]
    assert "DUE TO JOB REQUEUE" in runs[1], runs[1]
    for run in runs:
        _assert_world(run, 2)
    done = 0
    for i, run in enumerate(runs):
        m = re.search(rf"epochs (\d+)\.\.{TRAIN_EPOCHS}(;|$)", run, re.M)
        assert m, f"run {i} has no 'epochs S..E' line:\n{run}"
        start = int(m.group(1))
        if i > 0:
            assert "resuming from the checkpoint" in run, run
            # resumed from the last checkpoint written: the last epoch printed, or the one
            # before it if the kill came between the print and the save
            assert start >= 1 and done - 1 <= start <= done, (i, start, done, text)
        epochs = sorted(_epochs(run))
        if epochs:
            assert epochs == list(range(start + 1, epochs[-1] + 1)), (i, epochs)
            done = epochs[-1]
    assert done == TRAIN_EPOCHS, text
    # the interrupted trajectory is the uninterrupted one, epoch by epoch
    reference = _epochs(plain_training)
    merged: dict[int, tuple[str, str]] = {}
    for run in runs:
        merged.update(_epochs(run))
    assert merged == reference, f"resumed training diverged:\n{merged}\nvs\n{reference}"
    assert _final_accuracy(runs[-1]) == _final_accuracy(plain_training) >= 0.9, runs[-1]


def test_elastic_job_relaunches_after_a_rank_dies(slurm: Slurm, tmp_path: Path) -> None:
    """jobs/elastic.sbatch: rank 1 SIGKILLs itself at step 3 of the first launch (an srun
    job step); the supervisor relaunches a step at the same size, the job resumes from
    the commit of step 2 (not from 0) and ends 0 with exactly the weights of 6 steps at 2
    ranks (step s adds 3 * (arange(7) + s))."""
    out = tmp_path / "out"
    out.mkdir()
    job, log = slurm.submit(
        "elastic.sbatch", "--ntasks=2",
        env={"ELASTIC_COMMIT_DIR": str(out / "commits"), "ELASTIC_MIN_NP": "1"},
        args=(str(ROOT / "tests" / "faults" / "launch_train.py"), str(out), "6", "3", "1"))
    text = _assert_ok(slurm, job, log, slurm.wait(job, 240))
    assert "launcher srun" in text and "relaunching from the last commit" in text, text
    assert json.loads((out / "launch-1.json").read_text())["first_step"] == 3, text
    result = json.loads((out / "result.json").read_text())
    assert result["history"] == [2] * 6 and result["restart"] == 1, result
    assert result["weights"] == [float(sum(3 * (i + s) for s in range(6))) for i in range(7)]
