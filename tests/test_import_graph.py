"""The package's modules import each other without a cycle: every import statement of every module
(at the top, inside functions, under TYPE_CHECKING) is an edge from the module to the module it names,
and the graph's strongly connected components are single modules. A layer that needs something of a
higher one takes it as an argument instead."""

from __future__ import annotations

import ast
from pathlib import Path

import subquadratic

ROOT = Path(subquadratic.__file__).parent


def module_names(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file below `package` (a package folder)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules its import statements name (`from a import b` names a.b where
    that is a module, else a)."""
    modules = module_names(package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = here.split(".")
                if node.level:
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                           for alias in node.names]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_package_has_no_import_cycle():
    graph = import_graph(ROOT)
    assert len(graph) > 100 and graph["subquadratic.cli"]  # the walk saw the package and its imports
    assert cycles(graph) == []


def test_the_check_finds_a_cycle_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import low\n")
    (pkg / "sub" / "low.py").write_text("def f():\n    from ..top import g\n")
    (pkg / "top.py").write_text("from .sub.low import f\nimport pkg.leaf\n")
    (pkg / "leaf.py").write_text("")
    graph = import_graph(pkg)
    assert graph["pkg.top"] == {"pkg.sub.low", "pkg.leaf"} and graph["pkg.sub"] == {"pkg.sub.low"}
    assert cycles(graph) == [["pkg.sub.low", "pkg.top"]]
