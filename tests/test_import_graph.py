"""No import cycles between latentforge's modules.

The graph is read from the sources with ``ast`` (nothing is imported): an edge A -> B for each
import A runs when it is imported, i.e. at module level, including those inside a module-level
``try`` / ``if`` / ``with`` block, but not those under ``if TYPE_CHECKING:`` (never run) nor
those inside functions and classes' methods (run on call). ``from x import y`` is an edge to
``x.y`` when that is a module, else to ``x``; ``import a.b`` is an edge to ``a.b``.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "latentforge"

# Cycles tolerated for now, as sorted tuples of module names, each with the reason. Empty: a new
# cycle is broken by moving the piece both modules need below both, not by adding it here.
KNOWN_CYCLES: dict[tuple[str, ...], str] = {}


def _module_names(src: Path, package: str) -> dict[str, Path]:
    names = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """The import statements a module runs when it is imported."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                found += _module_level_imports(node.body)
            found += _module_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                found += _module_level_imports(block)
        elif isinstance(node, ast.With):
            found += _module_level_imports(node.body)
    return found


def _resolve_relative(module: str, path: Path, node: ast.ImportFrom) -> str:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def import_graph(src: Path = SRC, package: str = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports at module level."""
    modules = _module_names(src, package)

    def owner(name: str) -> str | None:  # the module a dotted name lives in (a.b.func -> a.b)
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in _module_level_imports(ast.parse(path.read_text(), filename=str(path)).body):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = _resolve_relative(module, path, node) if node.level else node.module or ""
                targets = [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                dep = owner(target)
                if dep is not None and dep != module:
                    graph[module].add(dep)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path A -> ... -> A) per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm; the package is a few hundred modules deep at most
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
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_a_cycle(graph, comp) for comp in components]


def _a_cycle(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """The shortest cycle through the component's first module (breadth-first inside the component)."""
    start = min(comp)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(comp)}")


def test_no_import_cycles():
    graph = import_graph()
    assert "latentforge.train.run" in graph and "latentforge.inference" in graph["latentforge.train.run"]
    found = [c for c in cycles(graph) if tuple(sorted(set(c))) not in KNOWN_CYCLES]
    assert not found, "import cycles (move what both modules need below both): " + "; ".join(
        " -> ".join(c) for c in found)


def test_the_checker_finds_a_cycle(tmp_path):
    """The same checker on a small package with a cycle through a ``from`` import, one under
    ``if TYPE_CHECKING:`` (ignored) and one inside a function (ignored)."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("try:\n    from pkg.c import thing\nexcept ImportError:\n    pass\n")
    (pkg / "c.py").write_text("import pkg.a as a\nthing = 1\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import e\n"
                              "def f():\n    from pkg import e\n")
    (pkg / "e.py").write_text("from . import d\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.e"] == {"pkg.d"} and graph["pkg.d"] == set()
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]
