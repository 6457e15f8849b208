"""Operator definitions: families (templates) instantiated per model, with references."""

from enginetap.definitions.base import (
    CompareRule,
    Template,
    compile_reference,
    get_template,
    known_template,
    templates,
)

__all__ = ["CompareRule", "Template", "compile_reference", "get_template", "known_template",
           "templates"]
