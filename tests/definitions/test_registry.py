"""The family registry: an explicit list, no import circle, catalog instances that carry
their template and constants."""

from __future__ import annotations

import ast
from pathlib import Path

import enginetap
from enginetap.definitions import Instance, Template, get_template, instances_for_config, templates
from enginetap.definitions.families import FAMILIES
from enginetap.models import model_config

PACKAGE = Path(enginetap.__file__).parent


def _imports(path: Path) -> set[str]:
    """Modules of enginetap that ``path`` imports anywhere (also inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("enginetap"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("enginetap"))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return {name: _imports(path) & set(modules) - {name} for name, path in modules.items()}


def test_no_import_circle_through_the_definitions_package() -> None:
    graph = _graph()
    start = [m for m in graph if m.startswith("enginetap.definitions")]
    for origin in start:
        seen, todo = set(), list(graph[origin])
        while todo:
            module = todo.pop()
            assert module != origin, f"{origin} imports itself through {sorted(seen)}"
            if module not in seen:
                seen.add(module)
                todo.extend(graph.get(module, ()))


def test_the_registry_is_exactly_the_explicit_list() -> None:
    assert list(templates()) == [t.family for t in FAMILIES]
    assert len(set(templates())) == len(FAMILIES)
    # Every template a family module defines is listed: none is left out by mistake.
    defined = set()
    for path in (PACKAGE / "definitions").glob("*.py"):
        module = __import__(f"enginetap.definitions.{path.stem}", fromlist=["_"])
        defined |= {v.family for v in vars(module).values() if isinstance(v, Template)}
    assert defined == set(templates())


def test_catalog_instances_carry_template_and_constants() -> None:
    instances = instances_for_config(model_config("qwen3_next"))
    assert all(isinstance(i, Instance) for i in instances)
    for instance in instances:
        assert instance.template is get_template(instance.template.family)
        assert instance.template.instantiate(**instance.values) == instance.definition
        assert set(instance.template.const_axes) <= set(instance.values)
    # Qwen3-Next's norms scale by 1 + w: the offset family, not rmsnorm
    assert not any(i.template.family == "rmsnorm" for i in instances)
    norm = next(i for i in instances if i.template.family == "rmsnorm_offset")
    assert norm.values == {"hidden_size": 128, "dtype": "bfloat16"}
