"""Serial tests of what the benchmarks record: repository-relative paths and commands, and
the results page (docs/benchmarks.md) built from the stored results."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import common, make_docs  # noqa: E402

ABSOLUTE = re.compile(r"(?<![\w.`<])/(?:work|root|tmp|home|usr|opt)/|(?:site|dist)-packages")


def test_relative_paths_strip_the_checkout_and_package_dirs():
    site, dist = "site" + "-packages", "dist" + "-packages"  # (no such path in this file)
    text = (f"1000 {ROOT}/mpicoll/collectives.py:180(allreduce)\n"
            f"5 {ROOT}/.venv/lib/python3.12/{site}/mpi4py/__init__.py:1(<module>)\n"
            f"3 /usr/lib/python3/{dist}/numpy/core.py:7(f)\n"
            "1 {method 'get' of 'dict' objects}")
    assert common.relative_paths(text) == (
        "1000 mpicoll/collectives.py:180(allreduce)\n"
        "5 mpi4py/__init__.py:1(<module>)\n"
        "3 numpy/core.py:7(f)\n"
        "1 {method 'get' of 'dict' objects}")


def test_command_line_is_relative_to_the_repository():
    argv = ["--merge", str(ROOT / "mpicoll" / "t.json"), "-m", "8:1M", "--output",
            "docs/x.json"]
    assert common.command_line(4, "tune", argv) == (
        "mpirun -n 4 python -m bench.tune --merge mpicoll/t.json -m 8:1M --output docs/x.json")
    assert common.command_line(None, "tune", ["--rebuild", "t.json"]) == (
        "python -m bench.tune --rebuild t.json")


def test_results_page_has_dates_commands_and_no_machine_paths(tmp_path, monkeypatch):
    """docs/benchmarks.md rebuilt from docs/results/bench/: no absolute paths; every results
    section says when and how it was measured; reference text comes before the results."""
    if not (make_docs.DATA / "allreduce_n2.json").exists():
        pytest.skip("no stored results in this checkout")
    monkeypatch.setattr(make_docs, "DOC", tmp_path / "benchmarks.md")
    text = make_docs.write_markdown([2, 3, 4, 8])
    assert not ABSOLUTE.search(text), ABSOLUTE.search(text)
    assert "python -m bench.tune --output table.json" in text
    assert "MPICOLL_TUNING_FILE" in text
    reference, results = text.split("\n## Results\n", 1)
    assert "### What the columns mean" in reference
    assert not re.search(r"20\d\d-\d\d-\d\d", reference)          # no dated notes there
    sections = results.split("\n### ")[1:]
    for section in sections:
        title = section.splitlines()[0]
        if "|" in section and not title.startswith(("Where the issue-6", "Notes")):
            assert "Measured 20" in section and "python -m bench." in section, title
    shipped = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert shipped == text, "docs/benchmarks.md is stale: run python -m bench.make_docs --from-data"
