"""A numpy training job for the relaunching supervisor's tests (run by
tests/faults/test_launch.py under ``python -m mpicoll.elastic.launch``, not by pytest).

Usage: ``python launch_train.py OUT STEPS KILL_STEP VICTIM [disk|elastic [SLEEP]]``
(``VICTIM`` -1: no rank kills itself; ``SLEEP``: seconds each step waits, for tests that
kill a node from outside).

Every step all-reduces this rank's vector ``(rank + 1) * (arange(7) + step)`` (integers,
exact in float64 in any order) into ``weights``, appends the world size to ``history`` and
commits: through :mod:`mpicoll.elastic.disk` directly (``disk``, rank 0 saves and a new
launch loads and broadcasts) or through ``mpicoll.elastic.run`` and ``ObjectState``
(``elastic``). On the first launch (``MPICOLL_ELASTIC_RESTART=0``) rank ``VICTIM`` waits
until the commit of step ``KILL_STEP - 1`` is on disk, writes ``OUT/failed`` (the test's
discovery script then answers one slot fewer) and ``OUT/failure.json`` (its time), and
SIGKILLs itself. Rank 0 writes ``OUT/launch-<restart>.json`` after the first completed step
of each launch (times: process start, numpy imported, MPI initialised, imports
done, state loaded, step done) and
``OUT/result.json`` at the end.
"""
from __future__ import annotations

import time

T_START = time.time()

import json  # noqa: E402
import os  # noqa: E402
import pickle  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

T_NUMPY = time.time()
from mpi4py import MPI  # noqa: E402  (MPI_Init)

T_MPI = time.time()
import mpicoll  # noqa: E402
from mpicoll.elastic import disk  # noqa: E402

T_IMPORTED = time.time()
WIDTH = 7


def _write_json(path: Path, record: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def _die_after_commit(out: Path, step: int) -> None:
    """The victim: once the commit of ``step - 1`` is on disk, fail."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        payload = disk.load()
        if payload is not None and pickle.loads(payload)["step"] >= step:
            break
        time.sleep(0.005)
    (out / "failed").touch()
    _write_json(out / "failure.json", {"time": time.time(), "step": step})
    os.kill(os.getpid(), signal.SIGKILL)


class Job:
    """The training loop shared by both commit paths."""

    def __init__(self, out: Path, steps: int, kill_step: int, victim: int,
                 sleep: float = 0.0) -> None:
        self.out, self.steps, self.kill_step, self.victim = out, steps, kill_step, victim
        self.sleep = sleep
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.restart = disk.restart_count()
        self.loaded_at = 0.0
        self.first_step: int | None = None

    def step(self, state: dict) -> None:
        """One step on ``state`` (a dict or an ObjectState's attributes)."""
        s = state["step"]
        if self.restart == 0 and self.rank == self.victim and s == self.kill_step:
            _die_after_commit(self.out, s)
        if self.sleep:
            time.sleep(self.sleep)
        grad = (self.rank + 1) * (np.arange(WIDTH, dtype=np.float64) + s)
        state["weights"] = state["weights"] + mpicoll.allreduce(grad, op="sum")
        state["history"] = state["history"] + [self.size]
        state["step"] = s + 1

    def after_step(self, started_at: int) -> None:
        if self.first_step is None and self.rank == 0:
            self.first_step = started_at
            _write_json(self.out / f"launch-{self.restart}.json", {
                "restart": self.restart, "size": self.size, "first_step": started_at,
                "t_start": T_START, "t_numpy": T_NUMPY, "t_mpi": T_MPI,
                "t_imported": T_IMPORTED, "t_loaded": self.loaded_at,
                "t_step_done": time.time()})

    def finish(self, state: dict) -> None:
        if self.rank == 0:
            _write_json(self.out / "result.json", {
                "weights": [float(x) for x in state["weights"]],
                "history": state["history"], "step": state["step"],
                "restart": self.restart, "size": self.size})


def run_disk(job: Job) -> None:
    """Commits through mpicoll.elastic.disk directly."""
    state = {"step": 0, "weights": np.zeros(WIDTH), "history": []}
    if job.rank == 0:
        payload = disk.load()
        if payload is not None:
            state = pickle.loads(payload)
    state = job.comm.bcast(state, root=0)
    job.loaded_at = time.time()
    while state["step"] < job.steps:
        begun = state["step"]
        job.step(state)
        if job.rank == 0:
            disk.save(pickle.dumps(state))
        job.after_step(begun)
    job.finish(state)


def run_elastic(job: Job) -> None:
    """Commits through mpicoll.elastic.run and ObjectState (E1's API)."""
    import mpicoll.elastic as elastic  # noqa: PLC0415

    state = elastic.ObjectState(step=0, weights=np.zeros(WIDTH), history=[])

    @elastic.run(min_np=1)
    def train(state: elastic.ObjectState) -> None:
        job.loaded_at = time.time()
        while state.step < job.steps:
            begun = state.step
            view = {"step": state.step, "weights": state.weights, "history": state.history}
            job.step(view)
            state.step, state.weights, state.history = (view["step"], view["weights"],
                                                        view["history"])
            state.commit()
            job.after_step(begun)

    train(state)
    job.finish({"step": state.step, "weights": state.weights, "history": state.history})


def main() -> None:
    out = Path(sys.argv[1])
    steps, kill_step, victim = map(int, sys.argv[2:5])
    mode = sys.argv[5] if len(sys.argv) > 5 else "disk"
    job = Job(out, steps, kill_step, victim, float(sys.argv[6]) if len(sys.argv) > 6 else 0.0)
    {"disk": run_disk, "elastic": run_elastic}[mode](job)


if __name__ == "__main__":
    main()
