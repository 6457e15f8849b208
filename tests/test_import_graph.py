"""The package's layering, read from the source: a folder imports only folders below it
(README's layout lists them bottom-up), no two folders and no two modules import each
other (directly or in a circle).

Every import counts, at module level or inside a function (a deferred import is still a
dependency: it only moves the cost), except those under ``if TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import enginetap

ROOT = Path(enginetap.__file__).parent

LAYERS: list[tuple[str, ...]] = [
    ("enginetap", "enginetap.errors"),  # the package itself: its version only
    ("enginetap.core",),
    ("enginetap.dataset",),
    ("enginetap.definitions",),
    ("enginetap.replay",),
    ("enginetap.guard",),
    ("enginetap.patches",),
    ("enginetap.capture",),
    ("enginetap.tap",),
    ("enginetap.capabilities", "enginetap.config"),
    ("enginetap.models",),
    ("enginetap.engines",),
    ("enginetap.traffic",),
    ("enginetap.jobs",),
    ("enginetap.cli",),
]
"""Bottom first: a module may import its own layer and those before it."""

UPWARD_ALLOWED: set[tuple[str, str]] = set()
"""(module, imported) pairs that point upward today and are being moved."""

FOLDER_EDGES_ALLOWED: set[tuple[str, str]] = set()
"""Folder edges (importer, imported) left out of the circle check while being fixed."""

MODULE_CIRCLES_ALLOWED: set[frozenset[str]] = set()
"""Module circles (deferred imports counted) left in while being fixed."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _walk(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node``, in function bodies too; none under
    ``if TYPE_CHECKING``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            for other in child.orelse:
                yield from _walk(ast.Module(body=[other], type_ignores=[]))
        elif isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        else:
            yield from _walk(child)


def _imports(path: Path, module: str) -> set[str]:
    """enginetap modules (and names in them) that ``module`` imports."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
            continue
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
        found.add(base)
        found |= {f"{base}.{a.name}" for a in node.names}
    return {name for name in found if name.startswith("enginetap")}


@functools.cache
def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py") if "refs" not in p.parts}


@functools.cache
def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {m for m in _imports(path, name) if m in modules and m != name}
            for name, path in modules.items()}


def _layer(module: str) -> int:
    best = -1, 0
    for index, layer in enumerate(LAYERS):
        for prefix in layer:
            if module == prefix or module.startswith(prefix + "."):
                best = max(best, (len(prefix), index))
    return best[1]


def _folder(module: str) -> str:
    """The folder a module lies in; a module beside the package's ``__init__`` (errors,
    config, capabilities) is a folder of its own."""
    path = _modules()[module]
    if path.parent == ROOT:
        return module
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(trail[trail.index(dep):] + [dep] if dep in trail else [node, dep])
            elif dep not in state:
                visit(dep, trail + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_core_imports_no_feature():
    allowed = ("enginetap.core", "enginetap.errors")
    bad = {m: sorted(d for d in deps if not d.startswith(allowed) and d != "enginetap")
           for m, deps in _graph().items() if m.startswith("enginetap.core")}
    assert {m: d for m, d in bad.items() if d} == {}


def test_every_module_has_a_layer():
    assert [m for m in _modules() if not any(
        m == p or m.startswith(p + ".") for layer in LAYERS for p in layer)] == []


def test_no_upward_import():
    upward = sorted((m, d) for m, deps in _graph().items() for d in deps
                    if _layer(d) > _layer(m))
    assert [pair for pair in upward if pair not in UPWARD_ALLOWED] == []
    assert [pair for pair in sorted(UPWARD_ALLOWED) if pair not in upward] == [], \
        "no longer upward: take these off UPWARD_ALLOWED"


def _folder_edges() -> dict[tuple[str, str], list[str]]:
    """(folder, folder it imports) → the module imports that make the edge. A package's
    ``__init__`` importing what lies below it is how it exports: not an edge."""
    modules = _modules()
    edges: dict[tuple[str, str], list[str]] = {}
    for module, deps in _graph().items():
        mine, exported = _folder(module), modules[module].name == "__init__.py"
        for dep in sorted(deps):
            theirs = _folder(dep)
            if theirs != mine and not (exported and dep.startswith(module + ".")):
                edges.setdefault((mine, theirs), []).append(f"{module} -> {dep}")
    return edges


def test_no_circle_between_folders():
    edges = _folder_edges()
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        if (a, b) not in FOLDER_EDGES_ALLOWED:
            graph.setdefault(a, set()).add(b)
            graph.setdefault(b, set())
    reach = {node: _reachable(graph, node) for node in graph}
    circles = sorted(f"{a} -> {b} ({edges[a, b][0]}), and {b} leads back to {a}"
                     for a in graph for b in graph[a] if a in reach[b])
    assert circles == []
    assert [e for e in sorted(FOLDER_EDGES_ALLOWED) if e not in edges] == [], \
        "gone: take these off FOLDER_EDGES_ALLOWED"


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for dep in graph[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def test_no_import_circle():
    """Between modules, deferred imports included: two modules that need each other are
    one concept split badly (or a third module they should share)."""
    cycles = _cycles(_graph())
    # a package importing its own submodule is how packages export: not a circle
    real = {frozenset(c) for c in cycles
            if not all(a.startswith(c[0] + ".") or a == c[0] for a in c)}
    assert sorted(map(sorted, real - MODULE_CIRCLES_ALLOWED)) == []
    assert sorted(map(sorted, MODULE_CIRCLES_ALLOWED - real)) == [], \
        "gone: take these off MODULE_CIRCLES_ALLOWED"
