"""Smoke test of bench/compression.py's all-reduce mode at every world size."""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

from compression_cases import RANK, SIZE

ROOT = str(Path(__file__).resolve().parents[3])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

pytestmark = pytest.mark.mpi


def test_allreduce_mode_runs():
    from bench import compression as bench_compression  # noqa: PLC0415

    # (no pytest tmp_path: every rank's pytest would clean the same base directory)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        rc = bench_compression.main(["allreduce", "-m", "4K:8K", "-i", "2", "-x", "0",
                                     "--codecs", "int8", "topk:0.1", "--layouts", "flat",
                                     "node", "--format", "json", "--output", str(out)])
        assert rc == 0
        rows = json.loads(out.read_text()) if RANK == 0 else []
    if RANK == 0:
        assert {r["method"] for r in rows} == {"native", "ring", "int8@flat", "int8@node",
                                               "topk:0.1@flat", "topk:0.1@node"}
        assert {r["bytes"] for r in rows} == {4096, 8192}
        for r in rows:
            assert r["n"] == SIZE and r["median_s"] > 0
            if r["method"] == "native":
                assert r["rel_error_first_call"] == 0
                assert r["inter_node_bytes_total"] is None
            elif "@" in r["method"]:
                assert 0 <= r["inter_node_bytes_per_rank"] <= r["bytes_sent_per_rank"]
                assert r["inter_node_bytes_total"] >= r["inter_node_bytes_per_rank"]


@pytest.mark.parametrize("mode", ["reducescatter", "allgather"])
def test_reduce_scatter_and_allgather_modes_run(mode):
    from bench import compression as bench_compression  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        rc = bench_compression.main([mode, "-m", "4K:4K", "-i", "1", "-x", "0", "--codecs",
                                     "int8", "--format", "json", "--output", str(out)])
        assert rc == 0
        rows = json.loads(out.read_text()) if RANK == 0 else []
    if RANK == 0:
        assert [r["method"] for r in rows] == ["native", "ring", "int8"]
        native, _, int8 = rows
        assert 0 <= int8["bytes_sent_per_rank"] < native["bytes_sent_per_rank"] or SIZE == 1
        assert native["rel_error_first_call"] == 0 and int8["rel_error_first_call"] < 0.05
