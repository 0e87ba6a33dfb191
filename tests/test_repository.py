"""Checks on the tracked files themselves: no machine paths, docs made from their source."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mpicoll import config

ROOT = Path(__file__).resolve().parents[1]

#: Paths that only exist on the machine that wrote them.
MACHINE_PATHS = [
    re.compile(r"(?<![\w.~-])/(?:work|root|home|Users)/[\w.-]+"),  # checkouts, home dirs
    re.compile(r"/tmp/tmp\w{4,}"),                                   # mkstemp/mkdtemp names
    re.compile(r"\S*/(?:site|dist)-packages/"),                      # an installed tree
]


def _tracked_text_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = []
    for name in out.decode().split("\0"):
        path = ROOT / name
        if name and path.is_file() and b"\0" not in path.read_bytes()[:8192]:
            files.append(path)
    return files


def machine_paths(text: str) -> list[str]:
    """The absolute paths of a particular machine found in ``text``."""
    own = {str(ROOT), sys.prefix, sys.base_prefix, str(Path.home())} - {"/", ""}
    found = [m.group(0) for pattern in MACHINE_PATHS for m in pattern.finditer(text)]
    return found + [p for p in own if p in text]


def test_the_check_catches_machine_paths():
    assert machine_paths("see /work/main/mpicoll/collectives.py:180(allreduce)")
    assert machine_paths('"json": "/tmp/tmpkrq8yfn7.json"')
    assert machine_paths("/opt/py/lib/python3.11/site-packages/numpy/core.py")
    assert machine_paths(f"{ROOT}/bench/overhead.py")
    assert not machine_paths("mpicoll/collectives.py:180 and /tmp/mpicoll-slurm/env")


def test_tracked_files_carry_no_machine_paths():
    bad = {}
    for path in _tracked_text_files():
        if path.resolve() == Path(__file__).resolve():
            continue  # its own examples above
        found = machine_paths(path.read_text(errors="replace"))
        if found:
            bad[str(path.relative_to(ROOT))] = sorted(set(found))[:3]
    assert not bad, f"absolute paths of this machine in tracked files: {bad}"


def _tool_variables():
    """.ci/variables.py (the tools' variables and the page generator), loaded by path."""
    spec = importlib.util.spec_from_file_location("_tool_variables",
                                                  ROOT / ".ci" / "variables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_variables_page_is_made_from_config():
    page = (ROOT / "docs" / "variables.md").read_text()
    assert page == _tool_variables().page(), (
        "docs/variables.md is out of date with mpicoll.config.VARIABLES and "
        ".ci/variables.py; rewrite it with: python .ci/variables.py > docs/variables.md")


def _variables_read(*patterns: str) -> set[str]:
    used = set()
    for pattern in patterns:
        for path in ROOT.glob(pattern):
            if path.is_file() and path.name != "test_repository.py":
                used |= set(re.findall(r"MPICOLL_[A-Z][A-Z_]*[A-Z]",
                                       path.read_text(errors="replace")))
    return used


def test_every_variable_the_code_reads_is_listed():
    """The library declares what it reads (mpicoll.config.VARIABLES) and nothing else;
    the checkout's tools and tests declare theirs in .ci/variables.py."""
    library = {v.name for v in config.VARIABLES}
    tools = {v.name for v in _tool_variables().TOOL_VARIABLES}
    assert not library & tools, f"declared twice: {sorted(library & tools)}"
    in_package = _variables_read("mpicoll/**/*.py")
    assert in_package <= library, ("read by mpicoll/ but missing from "
                                   f"mpicoll.config.VARIABLES: {sorted(in_package - library)}")
    used = _variables_read("jobs/*", ".ci/**/*", "cluster/*", "tests/**/*.py", "bench/*.py")
    listed = library | tools
    assert used <= listed, f"missing from .ci/variables.py: {sorted(used - listed)}"


#: A markdown link or image: ``[text](target)``, ``![alt](target "title")``.
MARKDOWN_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def relative_links(text: str) -> list[str]:
    """The relative link targets of a markdown text (anchors dropped), outside code."""
    text = re.sub(r"^ {0,3}(`{3,}|~{3,}).*?^ {0,3}\1", "", text, flags=re.M | re.S)  # fences
    text = re.sub(r"`[^`\n]*`", "", text)                                            # spans
    targets = []
    for target in MARKDOWN_LINK.findall(text):
        path = target.split("#", 1)[0]
        if path and not re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, mailto:
            targets.append(path)
    return targets


def test_the_link_finder():
    text = ("[a](docs/x.md#s) ![p](results/p.png) [w](https://x.org/y) [s](#top)\n"
            "`[c](code.md)`\n```\n[f](fenced.md)\n```\n[t](t.md \"title\")")
    assert relative_links(text) == ["docs/x.md", "results/p.png", "t.md"]


def test_docs_links_resolve():
    """Every relative link of README.md and docs/**/*.md names a file or folder that exists
    (catches links left behind when pages or their data move)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = {}
    for page in pages:
        for target in relative_links(page.read_text(encoding="utf-8")):
            path = (page.parent / target).resolve()
            if not path.exists() or ROOT.resolve() not in (path, *path.parents):
                broken.setdefault(str(page.relative_to(ROOT)), []).append(target)
    assert not broken, f"relative links to missing files: {broken}"
