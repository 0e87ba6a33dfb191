"""Fault catalogue: a parameter-server *server* is killed; restarting from the last
checkpoint gives the identical next step.

One training job (``examples/ps_train.py``, 1 server + 3 workers, adam, a checkpoint every
``EVERY`` rounds) has its server rank killed with SIGKILL once a checkpoint exists; the
job must end by itself, non-zero, within ``END_WITHIN`` seconds. Then, from the last
committed checkpoint (round ``c``):

- the same layout (1 server + 3 workers) and 2 servers + the same 3 workers (one rank
  more, ``--reshard``): the restored parameters and the next step (round ``c + 1``) are
  bitwise those of an uninterrupted run at rounds ``c`` and ``c + 1``. Each worker's
  minibatch is a function of (seed, worker index, clock), and the servers' update is
  elementwise with gradients summed in worker order, so the number of servers cannot
  change a bit;
- 1 server + 2 workers (one rank fewer, ``--reshard``): the data are sharded over the
  workers, so the next step's gradient is a different one and cannot equal the
  uninterrupted run's. What is identical: the restored parameters (bitwise those of the
  uninterrupted run at round ``c``), and the next step equals the server's rule applied
  in one process to the checkpointed state (parameters, adam moments, step count) with
  the average of the two workers' gradients at round ``c``.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mpi_launcher import mpirun_command

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ps_train.py"
EVERY = 3           #: rounds between checkpoints
END_WITHIN = 30     #: seconds the killed job may take to end
TIMEOUT = 90        #: any one job (a hang is what this catches)
COMMON = ["--optimizer", "adam", "--lr", "0.02", "--hidden", "16", "--log-every", "1000000",
          "--split-bytes", "64"]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1",
                OMP_NUM_THREADS="1")


def _command(n: int, args: list[str]) -> list[str]:
    return mpirun_command(n) + [sys.executable, "-m", "mpi4py", str(EXAMPLE), *COMMON, *args]


def _run(n: int, args: list[str]) -> str:
    cmd = _command(n, args)
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                             timeout=TIMEOUT, start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"job did not end within {TIMEOUT} s: {' '.join(cmd)}\n{exc.stderr}")
    assert out.returncode == 0, f"{' '.join(cmd)}\n{out.stdout}\n{out.stderr}"
    return out.stdout


def _children() -> dict[int, list[int]]:
    """Every process's children (from /proc)."""
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of MPI rank ``rank`` among the descendants of ``launcher`` (its PMI_RANK)."""
    kids, todo = _children(), [launcher]
    while todo:
        pid = todo.pop()
        try:
            env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        except OSError:
            env = []
        if f"PMI_RANK={rank}".encode() in env:
            return pid
        todo += kids.get(pid, [])
    return None


def _manifest(path: Path) -> dict | None:
    try:
        return json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


def _kill_server_after_a_checkpoint(ckpt: Path) -> int:
    """Start the long job, SIGKILL its server (rank 0) once a checkpoint is committed, and
    return the round of the last committed checkpoint."""
    cmd = _command(4, ["--servers", "1", "--steps", "100000000", "--save", str(ckpt),
                       "--save-every", str(EVERY)])
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while _manifest(ckpt) is None and proc.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(0.02)
        server = _rank_pid(proc.pid, 0)
        assert server is not None and proc.poll() is None, "the server rank is gone"
        os.kill(server, signal.SIGKILL)
        try:
            _, err = proc.communicate(timeout=END_WITHIN)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job went on for {END_WITHIN} s after its server was killed")
        assert proc.returncode != 0, err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    clocks = _manifest(ckpt)["worker_clocks"]
    assert len(set(clocks)) == 1 and clocks[0] % EVERY == 0, clocks
    return clocks[0]


def _params_at(dump: Path, clock: int) -> dict[str, np.ndarray]:
    with np.load(dump) as z:
        return {k.split("/", 1)[1]: z[k] for k in z.files if k.split("/")[0] == str(clock)}


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert want and sorted(got) == sorted(want), what
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=f"{what}: {k}")


def _example_module():
    spec = importlib.util.spec_from_file_location("ps_train_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _replay_next_step(ckpt: Path, params: dict[str, np.ndarray], clock: int,
                      workers: int) -> dict[str, np.ndarray]:
    """The server's bsp adam step on the checkpointed state, in one process: ``workers``
    workers' gradients at ``clock`` (the example's data and minibatch rule), summed in
    worker order and averaged."""
    from mpicoll.ps import checkpoint
    from mpicoll.ps.optimizers import check_hyperparameters
    from mpicoll.ps.placement import Placement, specs_from_params
    from mpicoll.ps.server import ShardState

    ex = _example_module()
    grads = []
    for w in range(workers):
        x, y = ex.worker_data(0, 8000, w, workers)
        idx = ex.minibatch(0, w, clock, len(y), 64)
        grads.append(ex.gradients({k: v.copy() for k, v in params.items()}, x[idx], y[idx]))
    manifest = checkpoint.read_manifest(str(ckpt))
    placement = Placement(specs_from_params(params), 1, 1 << 30)
    loader = checkpoint.ShardLoader(str(ckpt), manifest)
    hyper = check_hyperparameters("adam", {"lr": 0.02})
    out = {}
    for name in sorted(params):
        state = ShardState(placement.shards[name][0], "adam", hyper, list(range(workers)))
        loader.load(state, None)
        np.testing.assert_array_equal(state.param, params[name].reshape(-1))
        acc = grads[0][name].reshape(-1).copy()
        for g in grads[1:]:
            acc += g[name].reshape(-1)
        np.divide(acc, workers, out=acc)
        state.opt.apply(state.param, acc)
        out[name] = state.param.reshape(params[name].shape)
    loader.close()
    return out


@pytest.mark.timeout(4 * TIMEOUT)
def test_killed_server_restart_gives_the_identical_next_step(tmp_path):
    ckpt = tmp_path / "ckpt"
    c = _kill_server_after_a_checkpoint(ckpt)
    assert c >= EVERY
    _run(4, ["--servers", "1", "--steps", str(c + 1), "--dump", str(tmp_path / "ref.npz")])
    ref = {k: _params_at(tmp_path / "ref.npz", k) for k in (c, c + 1)}
    for n, servers, label in ((4, 1, "same"), (5, 2, "two-servers")):
        dump = tmp_path / f"{label}.npz"
        reshard = ["--reshard"] if servers != 1 else []
        _run(n, ["--servers", str(servers), "--restore", str(ckpt), *reshard, "--steps",
                 "1", "--dump", str(dump)])
        _assert_same(_params_at(dump, c), ref[c], f"{label}: restored state")
        _assert_same(_params_at(dump, c + 1), ref[c + 1], f"{label}: next step")
    dump = tmp_path / "fewer.npz"
    _run(3, ["--servers", "1", "--restore", str(ckpt), "--reshard", "--steps", "1",
             "--dump", str(dump)])
    _assert_same(_params_at(dump, c), ref[c], "2 workers: restored state")
    _assert_same(_params_at(dump, c + 1), _replay_next_step(ckpt, ref[c], c, 2),
                 "2 workers: next step = the server's rule on the checkpointed state")
