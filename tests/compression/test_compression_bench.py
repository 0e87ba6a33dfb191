"""Smoke test of bench/compression.py's codec mode (tiny size, one run, no thresholds)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def test_codecs_mode_writes_rows(tmp_path, capsys):
    from bench import compression as bench_compression  # noqa: PLC0415

    out = tmp_path / "rows.json"
    rc = bench_compression.main(["codecs", "-s", "64K", "-i", "1", "--codecs", "int8",
                                 "onebit", "topk:0.1", "--format", "json", "--output",
                                 str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())
    assert [r["codec"] for r in rows] == ["int8", "onebit", "topk:0.1"]
    assert all(r["gbps"] > 0 and r["wire_bytes"] > 0 for r in rows)
    assert "codec throughput" in capsys.readouterr().out
