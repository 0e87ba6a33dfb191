"""The relaunching supervisor ``python -m mpicoll.elastic.launch`` under MPICH (no ULFM:
a dead rank ends the whole job, the supervisor relaunches it from the commit on disk).

- resume: launch_train.py at 4 ranks, rank 2 SIGKILLs itself at step 3 (after the commit
  of step 2 is on disk); the discovery script then answers 3 slots; the supervisor
  relaunches at 3 ranks with ``MPICOLL_ELASTIC_RESTART=1``, the job resumes at step 3 (not
  0) and ends with exactly the weights of 3 steps at 4 ranks and 5 at 3 (a reference
  computed here), through ``mpicoll.elastic.disk`` directly and through
  ``mpicoll.elastic.run`` + ``ObjectState`` (3 -> 2 ranks);
- restarts bounded, fewer than ``--min-np`` slots (at the start and after a failure),
  bad commands, options and discovery output: a clear message, the documented status;
- SIGTERM to the supervisor: status 143, and no process of the job is left.

The cheap cases run the supervisor in this process (``launch.main``); the resume and
SIGTERM cases run ``python -m mpicoll.elastic.launch`` as a user would.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mpicoll.elastic import disk, launch

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
TRAIN = HERE / "launch_train.py"
WIDTH = 7
#: Seconds one supervisor run may take (a hang is a failure).
RUN_TIMEOUT_S = 180


def _discovery_script(tmp_path: Path, before: str, after: str) -> Path:
    """A horovodrun-style discovery script: ``before`` until ``tmp_path/failed`` exists,
    then ``after``."""
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\nif [ -e '{tmp_path}/failed' ]; then printf '{after}\\n';"
                      f" else printf '{before}\\n'; fi\n")
    script.chmod(0o755)
    return script


def _events(commit_dir: Path) -> list[dict]:
    return [json.loads(line) for line in
            (commit_dir / launch.EVENTS_NAME).read_text().splitlines()]


def _reference(history: list[int]) -> np.ndarray:
    """The weights after steps at the world sizes ``history``: step s at n ranks adds
    sum_r (r + 1) * (arange + s) = n (n + 1) / 2 * (arange + s)."""
    weights = np.zeros(WIDTH)
    for step, n in enumerate(history):
        weights += n * (n + 1) // 2 * (np.arange(WIDTH) + step)
    return weights


def _supervise(args: list[str], timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "mpicoll.elastic.launch", *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
                          check=False)


@pytest.mark.parametrize("mode, sizes", [("disk", (4, 3)), ("elastic", (3, 2))])
def test_resumes_from_last_commit_at_smaller_size(tmp_path, mode, sizes):
    before, after = sizes
    steps, kill_step, victim = 8, 3, before - 2
    discover = _discovery_script(tmp_path, f"localhost:{before}", f"localhost:{after}")
    commits = tmp_path / "commits"
    proc = _supervise(["--min-np", "2", "--max-np", "4", "--max-restarts", "2",
                       "--host-discovery-script", str(discover), "--commit-dir", str(commits),
                       "--", sys.executable, str(TRAIN), str(tmp_path), str(steps),
                       str(kill_step), str(victim), mode])
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "relaunching from the last commit" in proc.stderr
    assert _events(commits)[-1] | {"time": 0} == {"event": "end", "status": 0,
                                                  "reason": "done", "time": 0}
    launches = [e for e in _events(commits) if e["event"] == "launch"]
    assert [(e["restart"], e["np"]) for e in launches] == [(0, before), (1, after)]
    # the relaunch resumed at the step of the failure, not from zero
    second = json.loads((tmp_path / "launch-1.json").read_text())
    assert (second["restart"], second["size"], second["first_step"]) == (1, after, kill_step)
    result = json.loads((tmp_path / "result.json").read_text())
    expected_history = [before] * kill_step + [after] * (steps - kill_step)
    assert result["history"] == expected_history
    assert result["step"] == steps and result["restart"] == 1
    np.testing.assert_array_equal(result["weights"], _reference(expected_history))
    # and differs from a run that restarted from zero or never failed
    assert not np.array_equal(_reference([after] * steps), _reference(expected_history))
    assert pickle_step(commits) == steps


def test_the_supervisor_leaves_no_shared_memory_segment():
    """The supervisor starts itself again without MPI: MPICH's singleton left its segment
    (/dev/shm/mpich_shm_<pid in hex>_0) behind on every run, one refused for bad options
    too (the machine of the tester that found it held hundreds)."""
    proc = subprocess.Popen([sys.executable, "-m", "mpicoll.elastic.launch", "--min-np", "5",
                             "--max-np", "2", "--", "true"], cwd=ROOT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err = proc.communicate(timeout=RUN_TIMEOUT_S)[1]
    assert proc.returncode == 2, err
    assert not list(Path("/dev/shm").glob(f"mpich_shm_{proc.pid:x}_*"))


def test_the_example_resumes_the_epoch_after_its_epoch_end_commit(tmp_path):
    """examples/train.py --elastic under the supervisor, rank 1 killed one step into the
    second epoch (the last commit is the first epoch's end): the relaunch trains the
    second epoch once. The epoch-end commit held the epoch before its increment, with
    the sampler already at the next: the relaunch trained the first epoch again."""
    proc = _supervise(["--min-np", "2", "--max-np", "2", "-np", "2", "--commit-dir",
                       str(tmp_path / "commits"), "--", sys.executable,
                       str(ROOT / "examples" / "train.py"), "--elastic", "--epochs", "2",
                       "--min-accuracy", "0", "--kill-rank", "1", "--kill-step", "23"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "relaunching from the last commit" in out and "SIGKILL" in out, out
    epochs = [line.split()[1] for line in proc.stdout.splitlines()
              if line.startswith("epoch ")]
    assert epochs == ["1/2", "2/2"], out


def pickle_step(commits: Path) -> int:
    """The step of the last commit on disk (both modes pickle a dict with ``step``)."""
    import pickle  # noqa: PLC0415

    os.environ[disk.ENV_DIR] = str(commits)
    try:
        return pickle.loads(disk.load())["step"]
    finally:
        del os.environ[disk.ENV_DIR]


def test_restarts_are_bounded(tmp_path, capsys):
    runs = tmp_path / "runs"
    job = f'echo "$MPICOLL_ELASTIC_RESTART $PMI_RANK $MPICOLL_ELASTIC_DIR" >> {runs}; exit 3'
    rc = launch.main(["--min-np", "2", "--max-np", "2", "--max-restarts", "2",
                      "--commit-dir", str(tmp_path / "c"), "--", "sh", "-c", job])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "2 restart(s) allowed (--max-restarts), giving up" in err
    seen = sorted(tuple(line.split()) for line in runs.read_text().splitlines())
    commit_dir = str((tmp_path / "c").resolve())
    assert seen == [(str(r), str(p), commit_dir) for r in range(3) for p in range(2)]
    # the event log ends with why the supervisor ended (it stopped at the last exit)
    end = _events(tmp_path / "c")[-1]
    assert (end["event"], end["status"]) == ("end", 1), end
    assert end["reason"].startswith("gave up: the job failed (exit status 3)"), end


def test_fewer_slots_than_min_np(tmp_path, capsys):
    discover = _discovery_script(tmp_path, "localhost:3", "localhost:1\\nlocalhost")
    # at the start
    rc = launch.main(["--min-np", "4", "--max-np", "4", "--host-discovery-script",
                      str(discover), "--", "true"])
    err = capsys.readouterr().err
    assert rc == 1 and "only 3 slot(s) on 1 host(s) alive (localhost:3), fewer than " \
        "--min-np 4" in err, err
    # after a failure: 'localhost' printed twice keeps its first entry (1 slot)
    rc = launch.main(["--min-np", "2", "--max-np", "3", "--host-discovery-script",
                      str(discover), "--elastic-timeout", "0.5", "--",
                      "sh", "-c", f"touch {tmp_path}/failed; exit 1"])
    err = capsys.readouterr().err
    assert rc == 1 and "relaunching" in err and "fewer than --min-np 2 after waiting 0.5 s" \
        in err, err


def test_bad_command_options_and_discovery(tmp_path, capsys):
    assert launch.main(["--min-np", "1", "--max-np", "2", "--",
                        str(tmp_path / "no-such-program")]) == 2
    assert "not found or not executable" in capsys.readouterr().err
    for bad in (["--min-np", "3", "--max-np", "2", "--", "true"],
                ["--min-np", "1", "--max-np", "2"],
                ["--min-np", "1", "--max-np", "2", "-np", "3", "--", "true"],
                ["--min-np", "1", "--max-np", "2", "--elastic-timeout", "nan", "--", "true"],
                ["--min-np", "1", "--max-np", "2", "--launcher-args", "'open", "--", "true"]):
        with pytest.raises(SystemExit) as exc:
            launch.main(bad)
        assert exc.value.code == 2
        assert "error:" in capsys.readouterr().err
    a_file = tmp_path / "a_file"  # (NaN waited forever; these two gave tracebacks, status 1)
    a_file.write_text("")
    for commit_dir in (a_file, a_file / "below"):
        assert launch.main(["--min-np", "1", "--max-np", "2", "--commit-dir", str(commit_dir),
                            "--", "true"]) == 2
        assert "--commit-dir" in capsys.readouterr().err
    nonsense = tmp_path / "nonsense.sh"
    nonsense.write_text("#!/bin/sh\necho 'host one:2'\n")
    nonsense.chmod(0o755)
    failing = tmp_path / "failing.sh"
    failing.write_text("#!/bin/sh\necho broken >&2\nexit 4\n")
    failing.chmod(0o755)
    for script, message in ((nonsense, "is not 'hostname' or 'hostname:slots'"),
                            (failing, "exited with 4: broken"),
                            (tmp_path / "absent.sh", "cannot run")):
        rc = launch.main(["--min-np", "1", "--max-np", "2", "--host-discovery-script",
                          str(script), "--", "true"])
        err = capsys.readouterr().err
        assert rc == 1 and message in err, err


def _alive(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2] != "Z"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_stopped_supervisor_leaves_no_process(tmp_path, signum):
    """SIGTERM: the supervisor ends the job and exits 143. SIGKILL (no handler runs): the
    launcher gets SIGTERM from the kernel (PR_SET_PDEATHSIG) and ends its ranks."""
    commits = tmp_path / "commits"
    job = f'echo $$ $PPID > {tmp_path}/pid.$PMI_RANK; exec sleep 120'
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    sup = subprocess.Popen([sys.executable, "-m", "mpicoll.elastic.launch", "--min-np", "2",
                            "--max-np", "2", "--commit-dir", str(commits), "--",
                            "sh", "-c", job], cwd=ROOT, env=env, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while len(list(tmp_path.glob("pid.*"))) < 2 or any(
                not p.read_text().strip() for p in tmp_path.glob("pid.*")):
            assert time.monotonic() < deadline, "the job did not start"
            assert sup.poll() is None, sup.stderr.read()
            time.sleep(0.1)
        pids = {int(x) for p in tmp_path.glob("pid.*") for x in p.read_text().split()}
        session = next(e["pid"] for e in _events(commits) if e["event"] == "started")
        sup.send_signal(signum)
        err = sup.communicate(timeout=60)[1]
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGKILL)
            sup.wait(timeout=10)
    if signum == signal.SIGTERM:
        assert sup.returncode == 128 + signal.SIGTERM, err
        assert "stopped by signal" in err
        end = _events(commits)[-1]
        assert (end["event"], end["status"], end["reason"]) == (
            "end", 128 + signal.SIGTERM, f"stopped by signal {int(signal.SIGTERM)}"), end
    else:
        assert sup.returncode == -signal.SIGKILL, err
    deadline = time.monotonic() + 15    # hydra's cleanup; zombies reaped by init
    while any(_alive(p) for p in pids | {session}) and time.monotonic() < deadline:
        time.sleep(0.05)
    from mpicoll.elastic.launch_process import job_processes  # noqa: PLC0415
    left = sorted({p for p in pids | {session} if _alive(p)}
                  | {p for p in job_processes(session) if _alive(p)})
    for pid in left:   # a failing test leaves nothing behind either
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"processes of the job left alive: {left}"


def _supervisor(tmp_path: Path, *options: str) -> launch.Supervisor:
    """A supervisor (not started) for ``true``, discovering ``localhost:4``."""
    args = launch.parse_args(["--min-np", "1", "--max-np", "3", "--host-discovery-script",
                              "echo localhost:4", *options, "--", "true"])
    return launch.Supervisor(args, tmp_path)


def test_bad_counts_are_refused(capsys):
    """--max-restarts below 0 or --slots below 1: argparse's error, status 2."""
    for bad in (["--max-restarts", "-1"], ["--slots", "0"], ["--elastic-timeout", "-1"]):
        with pytest.raises(SystemExit) as exc:
            launch.parse_args(["--min-np", "1", "--max-np", "2", *bad, "--", "true"])
        assert exc.value.code == 2
        assert "--max-restarts and --elastic-timeout must be >= 0" in capsys.readouterr().err


def test_np_sizes_only_the_first_launch(tmp_path):
    """-np sets the first launch's size (within the slots); relaunches take as many slots
    as --max-np allows."""
    supervisor = _supervisor(tmp_path, "-np", "2")
    assert supervisor.hosts_for_launch()[1] == 2
    supervisor.launches = 1
    assert supervisor.hosts_for_launch()[1] == 3


def test_an_unwritable_event_log_only_warns(tmp_path, caplog):
    """The event log cannot be appended to (its directory is gone): a warning, the event
    is still kept in memory."""
    supervisor = _supervisor(tmp_path / "missing")
    with caplog.at_level("WARNING", logger="mpicoll.elastic.launch"):
        supervisor.event("discovered", slots=4)
    assert "cannot append to the event log" in caplog.text
    assert supervisor.events[-1]["event"] == "discovered"


def test_jobs_get_the_users_mpi4py_setting_back(tmp_path, monkeypatch):
    """After the supervisor's re-exec the jobs see the user's MPI4PY_RC_INITIALIZE again
    (removed when the user had none), and the commit directory and restart count."""
    supervisor = _supervisor(tmp_path)
    monkeypatch.setenv(launch._REEXEC_MARK, "1")
    monkeypatch.setenv("MPI4PY_RC_INITIALIZE", "0")
    env = supervisor.job_env(2)
    assert env["MPI4PY_RC_INITIALIZE"] == "1" and launch._REEXEC_MARK not in env
    assert env[disk.ENV_DIR] == str(tmp_path) and env[disk.ENV_RESTART] == "2"
    monkeypatch.setenv(launch._REEXEC_MARK, launch._UNSET)
    assert "MPI4PY_RC_INITIALIZE" not in supervisor.job_env(0)


def test_a_signal_before_or_during_a_failing_launch_stops(tmp_path, monkeypatch):
    """A stop signal seen before a launch, or while a job failed, ends the supervisor
    with 128 + the signal and no relaunch."""
    supervisor = _supervisor(tmp_path)
    supervisor.stop_signal = signal.SIGTERM
    assert supervisor.run() == 128 + signal.SIGTERM and supervisor.launches == 0

    def failed_while_stopping(proc, stopping):
        proc.wait()
        supervisor.stop_signal = signal.SIGINT
        return 1

    supervisor.stop_signal = None
    monkeypatch.setattr(launch, "wait_job", failed_while_stopping)
    assert supervisor.run() == 128 + signal.SIGINT and supervisor.launches == 1


def test_a_launcher_that_cannot_start_is_an_error(tmp_path, monkeypatch, capsys):
    """mpiexec found but failing to start (OSError): status 1, naming it."""
    def start_job(argv, env):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(launch, "start_job", start_job)
    rc = launch.main(["--min-np", "1", "--max-np", "1", "--commit-dir", str(tmp_path),
                      "--", "true"])
    err = capsys.readouterr().err
    assert rc == 1 and "error: cannot start" in err and "Permission denied" in err, err


def test_a_signal_while_discovering_stops_the_supervisor(tmp_path, capsys):
    """SIGTERM while the discovery runs (here: sent by the script, which then fails):
    'stopped by signal 15', status 143, not the discovery's error."""
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\nkill -TERM $PPID\nexit 3\n")
    script.chmod(0o755)
    rc = launch.main(["--min-np", "1", "--max-np", "1", "--host-discovery-script",
                      str(script), "--commit-dir", str(tmp_path / "c"), "--", "true"])
    err = capsys.readouterr().err
    assert rc == 128 + signal.SIGTERM and "stopped by signal 15" in err, err


def test_the_supervisor_restarts_itself_without_mpi(monkeypatch):
    """Where importing mpicoll initialised MPI, ``python -m mpicoll.elastic.launch``
    execs itself again with MPI4PY_RC_INITIALIZE=0, keeping the user's value for the
    jobs; once re-executed it does not again."""
    seen = []

    def execve(path, argv, env):
        seen.append((path, argv, env))
        raise SystemExit(0)

    from mpi4py import MPI  # noqa: PLC0415

    # (finalized before the exec: not this process's MPI, which later tests use)
    monkeypatch.setattr(MPI, "Finalize", lambda: seen.append("finalized"))
    monkeypatch.setattr(launch.os, "execve", execve)
    monkeypatch.setattr(sys, "argv", ["launch.py", "--min-np", "1"])
    monkeypatch.setenv("MPI4PY_RC_INITIALIZE", "1")
    monkeypatch.delenv(launch._REEXEC_MARK, raising=False)
    with pytest.raises(SystemExit):
        launch._reexec_without_mpi()
    finalized, (path, argv, env) = seen
    assert finalized == "finalized" and path == sys.executable and argv[1:] == ["-m", "mpicoll.elastic.launch",
                                                   "--min-np", "1"]
    assert env["MPI4PY_RC_INITIALIZE"] == "0" and env[launch._REEXEC_MARK] == "1"
    monkeypatch.setenv(launch._REEXEC_MARK, "1")
    launch._reexec_without_mpi()                 # returns: already re-executed
    assert len(seen) == 2
