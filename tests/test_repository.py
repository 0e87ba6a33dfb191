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


#: MPI calls that only mpicoll.runtime may make: communicator creation and process-failure
#: handling (issue 32: every communicator from the runtime's registry, one failure path).
RUNTIME_ONLY = re.compile(
    r"\.(?:Dup|Idup|Dup_with_info|Split|Split_type|Create_group|Create_from_group|Shrink|"
    r"Spawn|Merge|Revoke|Get_failed|Ack_failed)\(|\bis_process_failure\b|ERR_PROC_FAILED")
#: Assignments that patch the interpreter's exit.
EXIT_PATCHES = re.compile(r"\bsys\.exit\s*=(?!=)|\bthreading\._shutdown\s*=(?!=)")


def runtime_only_calls(text: str) -> list[str]:
    """The lines of ``text`` (code, docstrings and comments included) that make a call
    only the runtime may make."""
    return [line.strip() for line in text.splitlines() if RUNTIME_ONLY.search(line)]


def test_the_runtime_check_catches_calls():
    assert runtime_only_calls("        self.p2p = comm.Dup()\n")
    assert runtime_only_calls("x = parent.Create_group(group, 7)")
    assert runtime_only_calls("if faults.is_process_failure(exc):")
    assert runtime_only_calls("    c.Revoke()")
    assert not runtime_only_calls("comms.dup(comm, 'ps')\ncomms.split(c, 0, r, 'ps')")
    assert EXIT_PATCHES.search("    sys.exit = recording_exit")
    assert not EXIT_PATCHES.search("if sys.exit == plain:")


def test_only_the_runtime_makes_communicators_and_handles_failures():
    """Outside mpicoll/runtime/ no module creates a communicator (``Dup``, ``Split``,
    ``Create_group``, ``Shrink``, ``Spawn``, ``Merge``, ...) or asks MPI about process
    failures (``Revoke``, ``Get_failed``, ``ERR_PROC_FAILED``): they ask the runtime."""
    bad = {}
    for path in sorted((ROOT / "mpicoll").rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[1] == "runtime":
            continue
        found = runtime_only_calls(path.read_text())
        if found:
            bad[str(rel)] = found[:3]
    assert not bad, f"communicators or failure handling outside mpicoll/runtime: {bad}"


def test_nothing_patches_the_interpreters_exit():
    bad = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "mpicoll").rglob("*.py"))
           if EXIT_PATCHES.search(p.read_text())]
    assert not bad, f"assignments to sys.exit or threading._shutdown in {bad}"


def test_no_import_cycles_between_mpicoll_modules():
    """The import graph of mpicoll/ (module-level imports) has no cycle, and the runtime
    imports nothing of mpicoll above it (only errors, config and itself)."""
    import ast  # noqa: PLC0415

    graph: dict[str, set[str]] = {}
    for path in sorted((ROOT / "mpicoll").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        name = ".".join(parts)
        package = parts if rel.name == "__init__" else parts[:-1]
        deps: set[str] = set()
        for node in ast.parse(path.read_text()).body:   # module level only
            if isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                mod = ".".join(base + ([node.module] if node.module else []))
                if not mod.startswith("mpicoll"):
                    continue
                for alias in node.names:
                    deps.add(f"{mod}.{alias.name}")
                deps.add(mod)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("mpicoll")}
        graph[name] = deps
    modules = set(graph)
    graph = {m: {d for d in ds if d in modules and d != m} for m, ds in graph.items()}
    runtime = {m for m in modules if m.startswith("mpicoll.runtime")}
    above = {m: sorted(d for d in graph[m] if d not in runtime and
                       d not in ("mpicoll.errors", "mpicoll.config", "mpicoll.waiting",
                                 "mpicoll"))
             for m in runtime}
    assert not any(above.values()), f"the runtime imports modules above it: {above}"
    # cycles: a package's __init__ importing its own submodules is not a cycle
    def edges(m: str) -> set[str]:
        return {d for d in graph[m] if not d.startswith(m + ".")}
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(m: str, stack: list[str]) -> bool:
        state[m] = 1
        for d in edges(m):
            if state.get(d) == 1 and not m.startswith(d + "."):
                cycle.extend(stack[stack.index(d):] + [m, d] if d in stack else [m, d])
                return True
            if d not in state and visit(d, stack + [d]):
                return True
        state[m] = 2
        return False

    for m in sorted(graph):
        if m not in state and visit(m, [m]):
            break
    assert not cycle, f"import cycle: {' -> '.join(cycle)}"
