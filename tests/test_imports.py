"""The package's own import graph: no cycles, and the layers of docs/design.md hold.

The graph is built from ``mpicoll``'s source (every ``import`` statement, function-level
ones included: a cycle hidden inside a function is still a cycle), not from what happens
to be loaded.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mpicoll"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _nearest(name: str, mods: dict[str, Path]) -> str:
    while name not in mods:
        name = name.rsplit(".", 1)[0]
    return name


def import_graph() -> dict[str, set[str]]:
    """module -> the mpicoll modules it imports (``from pkg import mod`` counts as mod)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {_nearest(a.name, mods) for a in node.names
                            if a.name.split(".")[0] == "mpicoll"}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base += node.module.split(".") if node.module else []
                else:
                    base = node.module.split(".")
                if base[0] != "mpicoll":
                    continue
                start = ".".join(base)
                for alias in node.names:
                    sub = f"{start}.{alias.name}"
                    targets.add(sub if sub in mods else _nearest(start, mods))
        targets.discard(mod)
        graph[mod] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_graph_sees_the_package():
    graph = import_graph()
    assert "mpicoll.collectives" in graph["mpicoll"]
    assert "mpicoll.algorithms.registry" in graph["mpicoll.selection"]
    assert "mpicoll.buffers" in graph["mpicoll.algorithms.plans"]  # "from .. import buffers"


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles inside mpicoll: " + "; ".join(" <-> ".join(c)
                                                                   for c in found)



def subpackage_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph with every subpackage of ``mpicoll`` (``mpicoll.torch``,
    ``mpicoll.ps``, ...) collapsed into one node; top-level modules stay themselves."""
    packages = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}

    def unit(mod: str) -> str:
        parts = mod.split(".")
        return ".".join(parts[:2]) if len(parts) > 1 and parts[1] in packages else mod

    collapsed: dict[str, set[str]] = {}
    for mod, targets in graph.items():
        collapsed.setdefault(unit(mod), set()).update(unit(t) for t in targets)
    for mod, targets in collapsed.items():
        targets.discard(mod)
    return collapsed


def test_subpackage_graph_collapses():
    collapsed = subpackage_graph({"mpicoll.torch.a": {"mpicoll.ps.b"},
                                  "mpicoll.ps.b": {"mpicoll.torch.c", "mpicoll.buffers"},
                                  "mpicoll.torch.c": set(), "mpicoll.buffers": set()})
    assert cycles(collapsed) == [["mpicoll.ps", "mpicoll.torch"]]


def test_no_cycles_between_subpackages():
    """A dependency between two subpackages runs one way (mpicoll.torch uses mpicoll.ps,
    never the reverse), even where no two modules form a cycle."""
    found = cycles(subpackage_graph(import_graph()))
    assert not found, "cycles between subpackages of mpicoll: " + "; ".join(
        " <-> ".join(c) for c in found)

#: What each layer may import (docs/design.md): lower layers never import upper ones.
LOWER = {"mpicoll.buffers", "mpicoll.ops", "mpicoll.partition", "mpicoll.topology",
         "mpicoll.context", "mpicoll.config", "mpicoll.errors", "mpicoll.fastpath",
         "mpicoll.waiting", "mpicoll.node_window"}


def test_algorithms_import_only_lower_layers():
    graph = import_graph()
    for mod, targets in graph.items():
        if mod.startswith("mpicoll.algorithms"):
            upward = {t for t in targets
                      if not t.startswith("mpicoll.algorithms") and t not in LOWER}
            assert not upward, f"{mod} imports {sorted(upward)} from above its layer"


def test_core_never_imports_the_adapters():
    graph = import_graph()
    for mod, targets in graph.items():
        if not mod.startswith(("mpicoll.torch", "mpicoll.ps")):
            adapters = {t for t in targets if t.startswith(("mpicoll.torch", "mpicoll.ps"))}
            assert not adapters, f"{mod} imports {sorted(adapters)}"
