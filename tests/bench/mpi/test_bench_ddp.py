"""Smoke tests of bench/ddp.py (DDP on "mpicoll" vs gloo vs DistributedOptimizer),
bench/ddp_inside.py and bench/dist_ops.py, at n=2
only: every mode runs a few steps, and the JSON holds one positive rate per mode and
repeat, and DDP's timers with ``--profile``. Never how fast anything is.
"""
from __future__ import annotations

import json

import pytest
from mpi4py import MPI


def _ddp():
    """bench.ddp, imported only where the test runs (it imports torch: seconds per rank)."""
    pytest.importorskip("torch")
    from bench import ddp  # noqa: PLC0415

    return ddp


comm = MPI.COMM_WORLD

# one world size is enough for a smoke test (the suite runs at 1, 2, 3; CI time)
pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120),
              pytest.mark.skipif(comm.Get_size() != 2, reason="bench.ddp smoke test at n=2")]


@pytest.mark.parametrize("model,modes", [
    ("cnn", "ddp-mpicoll,ddp-gloo,hvd,ddp-mpicoll-first,ddp-mpicoll-int8"),
    ("mlp", "ddp-mpicoll,ddp-gloo,ddp-none,local")])
def test_ddp_benchmark_runs_every_mode(tmp_path, model, modes):
    ddp = _ddp()
    out = comm.bcast(str(tmp_path / "ddp.json") if comm.rank == 0 else None, root=0)
    rc = ddp.main(["--modes", modes, "--steps", "2", "--warmup", "1", "--repeats", "2",
                   "--batch", "4", "--profile", "--format", "json", "--output", out,
                   "--model", model])
    assert rc == 0
    if comm.rank == 0:
        with open(out, encoding="utf-8") as fh:
            result = json.load(fh)
        assert [r["mode"] for r in result["rows"]] == modes.split(",")
        for row in result["rows"]:
            assert row["wall"] > 0 and len(row["runs"]) == 2
            if row["mode"].startswith("ddp-"):
                assert set(row["profile_ms"]) >= {"backward_comm", "backward_compute"}
        assert result["meta"]["ranks"] == comm.size
        assert result["meta"]["model"] == model
        assert result["meta"]["command"].startswith(f"mpirun -n {comm.size} python -m bench.ddp")


def test_ddp_benchmark_rejects_unknown_mode():
    ddp = _ddp()
    with pytest.raises(ValueError, match="unknown mode"):
        ddp.runner("ddp-nccl")
    with pytest.raises(ValueError):
        ddp.runner("ddp-mpicoll-lz4")


def test_ddp_inside_times_every_layer_of_the_backends_path():
    """bench.ddp_inside wraps each layer of the backend's path (a renamed layer fails it
    here), finds each called once per step (the model's one bucket) and puts the
    originals back."""
    pytest.importorskip("torch")
    from bench import ddp_inside  # noqa: PLC0415
    from mpicoll.torch.distributed import process_group  # noqa: PLC0415

    before = process_group.MPIProcessGroup.allreduce
    rows = ddp_inside.main(["--steps", "3", "--warmup", "2", "--batch", "4"])
    assert process_group.MPIProcessGroup.allreduce is before
    for label in ("backend allreduce", "lane submit", "agreement", "mpicoll allreduce",
                  "step: forward", "step: backward", "step: optimizer", "step"):
        assert rows[label][2] == 1, (label, rows)
        assert rows[label][0] > 0
    assert rows["backend allreduce"][0] >= rows["mpicoll allreduce"][0]


def test_dist_ops_times_every_operation_on_both_backends():
    """bench.dist_ops runs each operation on "mpicoll" and gloo (a smoke test)."""
    pytest.importorskip("torch")
    from bench import dist_ops  # noqa: PLC0415

    rows = dist_ops.main(["--sizes", "3,1000", "--steps", "2", "--repeats", "1"])
    assert {(r["operation"], r["bytes"], r["backend"]) for r in rows} == {
        (op, b, name) for op in dist_ops.OPERATIONS
        for b in (12, 4000) for name in ("mpicoll", "mpicoll-first", "gloo")}
    assert all(r["median_ms"] > 0 for r in rows)
