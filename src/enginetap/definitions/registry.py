"""Looking families up: by name, and from a stored definition (is it one of ours?).

Built from the explicit list in :mod:`enginetap.definitions.families` on first use.
"""

from __future__ import annotations

from functools import cache, lru_cache
from typing import Any

from enginetap.dataset.schema import Definition
from enginetap.definitions.base import Template, family_of, params_of
from enginetap.definitions.families import FAMILIES
from enginetap.errors import DefinitionError

__all__ = ["get_template", "instantiate", "known_template", "templates"]


@cache
def _registry() -> dict[str, Template]:
    registry: dict[str, Template] = {}
    for template in FAMILIES:
        if template.family in registry:
            raise DefinitionError(f"family {template.family!r} listed twice",
                                  "families.FAMILIES names each family once",
                                  "remove the duplicate entry")
        registry[template.family] = template
    return registry


def templates() -> dict[str, Template]:
    """Every family by name (a copy: callers may change it)."""
    return dict(_registry())


def get_template(family: str) -> Template:
    """The family called ``family``.

    Raises:
        DefinitionError: no such family.
    """
    try:
        return _registry()[family]
    except KeyError:
        raise DefinitionError(f"unknown definition family {family!r}",
                              f"known families: {sorted(_registry())}",
                              "use `enginetap definitions list` to see them") from None


def instantiate(family: str, /, cached: bool = False, **values: Any) -> Definition:
    """``get_template(family).instantiate(**values)``; ``cached`` keeps one definition per
    distinct values (a probe that builds one on every captured call: building renders the
    reference), which callers then share and must not change.

    Raises:
        DefinitionError: no such family, or ``values`` do not instantiate it.
    """
    if cached:
        return _instantiate_cached(family, tuple(sorted(values.items())))
    return get_template(family).instantiate(**values)


@lru_cache(maxsize=512)
def _instantiate_cached(family: str, values: tuple[tuple[str, Any], ...]) -> Definition:
    return get_template(family).instantiate(**dict(values))


def known_template(definition: Definition) -> Template | None:
    """The template that generated ``definition`` byte for byte, or None if it is foreign."""
    template = _registry().get(family_of(definition) or "")
    if template is None:
        return None
    try:
        ours = template.instantiate(**definition.const_axes, **params_of(definition, template))
    except (DefinitionError, ValueError, KeyError):
        return None
    return template if _executed(ours) == _executed(definition) else None


def _executed(definition: Definition) -> str:
    """What decides how a definition runs, as order-sensitive JSON: inputs are passed by
    position, so the same dict in another order is another definition."""
    return definition.model_dump_json(include={"name", "op_type", "axes", "inputs", "outputs",
                                               "reference", "constraints"})
