"""The package's layering, checked from the source: the lower layers (layers/, models/,
kernels/, graphs/) import nothing from engine/ or server/, and no two modules import each
other, directly or through others.

Imports are read with ``ast`` from every module, function-level (lazy) imports included;
only imports under ``if TYPE_CHECKING:`` are left out, since they never run. The checker is
first run on a small package with one violation of each kind, so the test fails if the
checker stops seeing them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import breakgraph

LOWER = ("layers", "models", "kernels", "graphs")
UPPER = ("engine", "server")


def module_name(path: Path, root: Path, package: str) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for orelse in child.orelse:
                    visit(orelse)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            visit(child)

    visit(tree)
    return found


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``. ``from a import b`` counts as an import
    of ``a.b`` where that is a module of the package, else of ``a``."""
    paths = {module_name(p, root, package): p for p in root.rglob("*.py")}
    packages = {module_name(p, root, package) for p in root.rglob("__init__.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        edges: set[str] = set()
        here = name if name in packages else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            for target in targets:
                while target and target not in paths:  # `import a.b.c` of a name inside a module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def uphill_imports(graph: dict[str, set[str]], package: str) -> list[str]:
    """``"importer -> imported"`` for each module of a lower layer importing an upper one."""
    lower = tuple(f"{package}.{d}" for d in LOWER)
    upper = tuple(f"{package}.{d}" for d in UPPER)

    def inside(mod: str, roots: tuple[str, ...]) -> bool:
        return any(mod == r or mod.startswith(r + ".") for r in roots)

    return sorted(
        f"{m} -> {t}" for m, targets in graph.items() if inside(m, lower) for t in targets if inside(t, upper)
    )


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(cycles)


def test_checker_sees_an_uphill_import_and_a_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    for folder in ("layers", "engine", "graphs"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "batch.py").write_text("X = 1\n")
    (pkg / "layers" / "attn.py").write_text("def f():\n    from pkg.engine.batch import X\n    return X\n")
    (pkg / "layers" / "typed.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.engine import batch\n"
    )
    (pkg / "graphs" / "a.py").write_text("from . import b\n")
    (pkg / "graphs" / "b.py").write_text("def g():\n    from pkg.graphs.a import h\n")
    graph = import_graph(pkg, "pkg")
    assert uphill_imports(graph, "pkg") == ["pkg.layers.attn -> pkg.engine.batch"]
    assert import_cycles(graph) == [["pkg.graphs.a", "pkg.graphs.b"]]


def test_lower_layers_import_nothing_from_engine_or_server():
    root = Path(breakgraph.__file__).parent
    graph = import_graph(root, "breakgraph")
    assert "breakgraph.layers.dsa" in graph and "breakgraph.engine.engine" in graph  # the walk saw the package
    assert uphill_imports(graph, "breakgraph") == []


def test_no_import_cycles():
    root = Path(breakgraph.__file__).parent
    assert import_cycles(import_graph(root, "breakgraph")) == []
