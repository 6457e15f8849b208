"""The package's layering, read from the source: core imports no feature, and no two
modules import each other (directly or in a circle) when they are imported."""

from __future__ import annotations

import ast
from pathlib import Path

import enginetap

ROOT = Path(enginetap.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str) -> set[str]:
    """enginetap modules imported at import time (module level, not inside functions,
    not under ``if TYPE_CHECKING``)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(sub, ast.Import):
                found |= {a.name for a in sub.names}
            elif isinstance(sub, ast.ImportFrom):
                base = sub.module or ""
                if sub.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - sub.level + 1]
                                    + ([base] if base else []))
                found.add(base)
                found |= {f"{base}.{a.name}" for a in sub.names}
    return {name for name in found if name.startswith("enginetap")}


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py") if "refs" not in p.parts}
    graph = {}
    for name, path in modules.items():
        graph[name] = {m for m in _imports(path, name) if m in modules and m != name}
    return graph


def test_core_imports_no_feature():
    allowed = ("enginetap.core", "enginetap.errors")
    bad = {m: sorted(d for d in deps if not d.startswith(allowed) and d != "enginetap")
           for m, deps in _graph().items() if m.startswith("enginetap.core")}
    assert {m: d for m, d in bad.items() if d} == {}


def test_no_import_circle():
    graph = _graph()
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
    # a package importing its own submodule is how packages export: not a circle
    real = [c for c in cycles if not all(a.startswith(c[0] + ".") or a == c[0] for a in c)]
    assert real == []
