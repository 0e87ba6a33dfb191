"""The core timeline: Chrome-trace events of every collective, merged across ranks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from mpi_launcher import mpirun_command

from mpicoll import timeline

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = textwrap.dedent("""
    import numpy as np, mpicoll
    from mpi4py import MPI
    x = np.arange(1000, dtype=np.float32)
    for _ in range(3):
        mpicoll.allreduce(x, algorithm="ring")           # the first call plans, then cached
    mpicoll.broadcast(x, root=1, algorithm="binomial")
    sub = MPI.COMM_WORLD.Split(MPI.COMM_WORLD.rank % 2)
    mpicoll.allgather(np.ones(5), comm=sub)
""")


def test_timeline_of_every_rank_merged_into_one_chrome_trace(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    trace = tmp_path / "trace.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), MPICOLL_TIMELINE=str(trace))
    out = subprocess.run(mpirun_command(3) + [sys.executable, str(script)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    assert not list(tmp_path.glob("trace.json.rank*")), "parts left after the merge"
    calls = [e for e in events if e["ph"] == "X"]
    assert sorted({e["pid"] for e in calls}) == [0, 1, 2]
    for rank in range(3):
        mine = [e for e in calls if e["pid"] == rank]
        names = [e["name"] for e in sorted(mine, key=lambda e: e["ts"])]
        assert names == ["allreduce"] * 3 + ["broadcast", "allgather"], names
        reduce3 = [e for e in mine if e["name"] == "allreduce"]
        assert [e["args"]["seq"] for e in reduce3] == [1, 2, 3]
        assert all(e["args"]["algorithm"] == "ring" and e["args"]["bytes"] == 4000
                   and e["dur"] >= 0 for e in reduce3)
    tracks = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert tracks == {"MPI_COMM_WORLD", "world ranks 0,2", "world ranks 1"}, tracks


def test_merge_command_joins_parts_left_behind(tmp_path):
    path = tmp_path / "t.json"
    for rank in (0, 1):
        part = tmp_path / f"t.json.rank{rank}"
        part.write_text(json.dumps({"name": "allreduce", "cat": "collective", "ph": "X",
                                    "pid": rank, "track": "w", "ts": 1.0 + rank,
                                    "dur": 2.0}) + "\n")
    assert timeline.main([str(path)]) == 0
    events = json.loads(path.read_text())["traceEvents"]
    assert sorted(e["pid"] for e in events if e["ph"] == "X") == [0, 1]
    assert not list(tmp_path.glob("t.json.rank*"))
