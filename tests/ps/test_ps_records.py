"""What the parameter-server benchmark records: no machine paths, the command relative to
the repository, and a results page that carries each result's date and command."""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import bench_ps  # noqa: E402

MACHINE_PATH = re.compile(r"(?<![\w.`<~-])/(?:work|root|tmp|home|Users)/|site-packages")


def test_training_record_drops_the_temporary_file_and_machine_paths():
    scratch = os.path.join(tempfile.gettempdir(), "tmpkrq8yfn7.json")   # as mkstemp names
    res = {"args": {"json": scratch, "save": str(ROOT / "ck"),
                    "restore": None, "steps": 3}, "log": [[0.1, 0, 1.0, 0.5]]}
    out = bench_ps.portable_record(res)
    assert out["args"] == {"save": "ck", "restore": None, "steps": 3}
    assert out["log"] == res["log"]
    assert not MACHINE_PATH.search(json.dumps(out))


def test_command_is_relative_to_the_repository():
    argv = ["all", "--configs", "cx2", "--out", str(ROOT / "docs" / "results")]
    assert bench_ps.command_line(None, "bench_ps", argv) == (
        "python -m bench.bench_ps all --configs cx2 --out docs/results")


def test_stored_results_have_date_command_and_no_machine_paths():
    text = (ROOT / "docs" / "results" / "ps_bench.json").read_text()
    assert not MACHINE_PATH.search(text), MACHINE_PATH.search(text)
    data = json.loads(text)
    assert re.fullmatch(r"20\d\d-\d\d-\d\d \d\d:\d\d UTC", data["date"])
    assert "bench_ps" in data["command"]
    page = (ROOT / "docs" / "results" / "ps.md").read_text()
    assert data["date"] in page
    # the page shows the command that made the stored data (written over two lines there)
    assert " ".join(page.replace("\\\n", " ").split()).count(
        " ".join(data["command"].split())) >= 1


def test_reference_page_links_results_and_keeps_dated_notes_out():
    ref = (ROOT / "docs" / "ps.md").read_text()
    assert "results/ps.md" in ref
    assert not re.search(r"20\d\d-\d\d-\d\d", ref)
    assert "returns on every rank" in ref


def test_straggler_modes_and_stored_results():
    assert bench_ps.mode_args("bsp:b1") == ["--consistency", "bsp", "--backup-workers", "1"]
    assert bench_ps.mode_args("ssp:2") == ["--consistency", "ssp", "--staleness", "2"]
    assert bench_ps.mode_args("asp") == ["--consistency", "asp", "--staleness", "0"]
    text = (ROOT / "docs" / "results" / "ps_stragglers.json").read_text()
    assert not MACHINE_PATH.search(text), MACHINE_PATH.search(text)
    data = json.loads(text)
    page = " ".join((ROOT / "docs" / "results" / "ps.md").read_text().replace("\\\n", " ")
                    .split())
    assert data["command"] in page and data["date"][:10] in page
    assert set(data["stragglers"]) == {"bsp", "bsp:b1", "ssp:2", "asp"}
    assert data["stragglers"]["bsp:b1"]["summary"]["late_pushes_dropped"] > 0
