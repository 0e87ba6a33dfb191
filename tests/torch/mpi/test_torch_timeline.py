"""``hvd.start_timeline`` / ``hvd.stop_timeline``: a tiny training recorded on every rank,
merged by rank 0 into one Chrome trace with Horovod's per-tensor activities."""
from __future__ import annotations

import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

import mpicoll.torch as hvd
from mpicoll.torch.state import engine

pytestmark = pytest.mark.mpi


def _train(steps: int) -> None:
    torch.manual_seed(hvd.rank())
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(5, 4)).square().mean().backward()
        optimizer.step()
    # a group runs in one round: its members fuse (tracks tl.fused.0 and tl.fused.1)
    hvd.grouped_allreduce([torch.ones(3) * i for i in range(2)], name="tl.fused")
    hvd.allgather(torch.ones(1 + hvd.rank(), 2), name="tl.gather")


def _by_rank(trace: dict) -> dict:
    """rank -> {track name: [events]} from a merged Chrome trace."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    out: dict = defaultdict(lambda: defaultdict(list))
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            out[e["pid"]][names[(e["pid"], e["tid"])]].append(e)
    return out


def _inside(inner: dict, outer: dict) -> bool:
    slack = 1.0                               # microseconds of rounding
    return (outer["ts"] - slack <= inner["ts"]
            and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + slack)


def test_timeline_of_a_tiny_training_has_every_rank_and_horovods_activities():
    directory = MPI.COMM_WORLD.bcast(tempfile.mkdtemp() if hvd.rank() == 0 else None)
    path = Path(directory) / "timeline.json"
    before = time.time()
    hvd.start_timeline(str(path), mark_cycles=True)
    try:
        _train(steps=3)
    finally:
        hvd.stop_timeline()
    after = time.time()
    # the ranks' windows together: a rank's events may start before rank 0's window opens
    # or end after it closes (the ranks start and stop at their own pace)
    windows = MPI.COMM_WORLD.allgather((before, after))
    first, last = min(w[0] for w in windows), max(w[1] for w in windows)
    hvd.barrier()
    if hvd.rank() != 0:
        return
    ranks = _by_rank(json.loads(path.read_text()))
    fusion = engine().settings.fusion_threshold > 0
    assert sorted(ranks) == list(range(hvd.size()))
    for rank, tracks in ranks.items():
        events = [e for track in tracks.values() for e in track]
        outside = [e for e in events if not (first * 1e6 <= e["ts"] and e["dur"] >= 0
                                             and e["ts"] + e["dur"] <= last * 1e6)]
        assert not outside, (rank, first * 1e6, last * 1e6, outside[:3])
        gradients = [t for t in tracks if t.startswith("allreduce.")]
        assert gradients, (rank, sorted(tracks))
        for track in [*gradients, "tl.fused.0", "tl.fused.1"]:
            kinds = {e["name"] for e in tracks[track]}
            assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE"} <= kinds, (rank, track, kinds)
        fused = tracks["tl.fused.0"]
        op = next(e for e in fused if e["name"] == "ALLREDUCE")
        activities = (("MEMCPY_IN_FUSION_BUFFER", "MEMCPY_OUT_FUSION_BUFFER")
                      if fusion else ()) + (      # MPICOLL_FUSION_THRESHOLD=0: none
            ("MPI_ALLREDUCE",) if hvd.size() > 1 else ())     # one rank reduces nothing
        for activity in activities:
            inner = next(e for e in fused if e["name"] == activity)
            assert _inside(inner, op), (rank, activity, inner, op)
        negotiate = next(e for e in fused if e["name"] == "NEGOTIATE_ALLREDUCE")
        assert negotiate["ts"] <= op["ts"] + 1.0
        assert {e["name"] for e in tracks["tl.gather"]} >= {"NEGOTIATE_ALLGATHER", "ALLGATHER"}
        assert any(t.startswith("broadcast.") for t in tracks), sorted(tracks)
        assert [e["name"] for e in tracks["cycles"]].count("CYCLE") >= 3 or hvd.size() == 1


def test_a_failed_operation_is_recorded_with_its_error(monkeypatch):
    """An operation that fails while it runs (here a broadcast whose run raises on every
    rank) is recorded on its tensor's track with the error in its arguments."""
    from mpicoll.torch.engine import execute

    def failing(engine_, bucket):
        raise RuntimeError("injected broadcast failure")

    monkeypatch.setitem(execute._RUNNERS, "broadcast", failing)
    directory = MPI.COMM_WORLD.bcast(tempfile.mkdtemp() if hvd.rank() == 0 else None)
    path = Path(directory) / "failed.json"
    hvd.start_timeline(str(path))
    try:
        with pytest.raises(Exception, match="injected broadcast failure"):
            hvd.broadcast(torch.ones(2), root_rank=0, name="tl.failed")
    finally:
        monkeypatch.undo()
        hvd.stop_timeline()
    hvd.barrier()
    if hvd.rank() != 0:
        return
    for rank, tracks in _by_rank(json.loads(path.read_text())).items():
        op = next(e for e in tracks["tl.failed"] if e["name"] == "BROADCAST")
        assert "injected broadcast failure" in op["args"]["error"], (rank, op)
