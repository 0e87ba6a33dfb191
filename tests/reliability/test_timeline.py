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


def _calls(path: Path) -> list[str]:
    return [e["name"] for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]


def test_start_while_recording_writes_the_first_timeline(tmp_path, monkeypatch):
    """start() while a timeline runs stops (and merges) that one first; events past
    FLUSH_EVENTS are flushed to the part file before stop; stop() without a timeline
    returns None."""
    monkeypatch.setattr(timeline, "FLUSH_EVENTS", 2)
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    timeline.start(first)
    try:
        for name in ("one", "two"):
            timeline.event(name, timeline.now(), timeline.now())
        part = tmp_path / "a.json.rank0"
        assert [json.loads(line)["name"] for line in part.read_text().splitlines()] == [
            "one", "two"]
        timeline.start(second)
        assert _calls(first) == ["one", "two"] and not part.exists()
        timeline.event("three", timeline.now(), timeline.now())
    finally:
        merged = timeline.stop()
    assert merged == second and _calls(second) == ["three"]
    assert timeline.stop() is None and not timeline.enabled()


def test_stop_leaves_the_parts_when_a_rank_never_finishes(tmp_path, monkeypatch, capsys):
    """Rank 0 waits MERGE_WAIT_SECONDS for every part; a missing rank's leaves the parts
    for the merge command and says so."""
    monkeypatch.setattr(timeline, "MERGE_WAIT_SECONDS", 0.2)
    path = tmp_path / "t.json"
    timeline.start(path)
    timeline.event("x", timeline.now(), timeline.now())
    monkeypatch.setitem(timeline._state, "size", 2)  # rank 1 never writes
    assert timeline.stop() is None
    err = capsys.readouterr().err
    assert "parts of ranks [1] not finished" in err and f"python -m mpicoll.timeline {path}" in err
    assert not path.exists() and (tmp_path / "t.json.rank0").exists()


def test_merge_runs_as_a_module(tmp_path):
    """``python -m mpicoll.timeline PATH`` merges the parts left behind, without runpy's
    RuntimeWarning (mpicoll imports its timeline: the command is a package's __main__)."""
    path = tmp_path / "t.json"
    (tmp_path / "t.json.rank0").write_text(json.dumps(
        {"name": "allreduce", "cat": "collective", "ph": "X", "pid": 0, "track": "w",
         "ts": 1.0, "dur": 2.0}) + "\n")
    out = subprocess.run([sys.executable, "-m", "mpicoll.timeline", str(path)],
                         capture_output=True, text=True, timeout=120, check=False,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0 and f"wrote {path}" in out.stdout, out.stderr
    assert "Warning" not in out.stderr, out.stderr
    assert _calls(path) == ["allreduce"]


def test_merge_never_overwrites_a_trace_and_skips_a_cut_line(tmp_path, capsys):
    """Run on a merged trace (no parts left) or a mistyped path, the merge says so and
    leaves the file (it wrote an empty trace over it); a part whose last line a killed
    rank cut off merges without that line (a JSON error stopped the whole merge)."""
    path = tmp_path / "t.json"
    path.write_text('{"traceEvents": [1]}\n')
    assert timeline.main([str(path)]) == 1
    assert path.read_text() == '{"traceEvents": [1]}\n'
    assert "no part files" in capsys.readouterr().err
    good = json.dumps({"name": "allreduce", "cat": "collective", "ph": "X", "pid": 0,
                       "track": "w", "ts": 1.0, "dur": 2.0})
    (tmp_path / "t.json.rank0").write_text(good + "\n" + '{"name": "allred')
    assert timeline.main([str(path)]) == 0
    assert _calls(path) == ["allreduce"]


def test_an_unusable_path_is_refused_at_the_start(tmp_path):
    """A missing directory or a directory as the path: ValueError at start() (it failed
    at exit, or at the 10,000th event inside a collective)."""
    import pytest

    for bad in (tmp_path / "missing" / "t.json", tmp_path):
        try:
            with pytest.raises(ValueError, match="timeline path"):
                timeline.start(bad)
        finally:
            timeline.ON = False
