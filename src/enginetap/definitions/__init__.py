"""Operator definitions: families (templates) instantiated per model, with references.

The families are listed in :mod:`~enginetap.definitions.families`; look them up with
:func:`templates` / :func:`get_template`; :func:`instances_for_config` says which a model
runs, each with its template and constants.
"""

from enginetap.definitions.base import CompareRule, Template, compile_reference
from enginetap.definitions.catalog import Instance, instances_for_config, instances_for_model
from enginetap.definitions.registry import get_template, instantiate, known_template, templates

__all__ = ["CompareRule", "Instance", "Template", "compile_reference", "get_template",
           "instances_for_config", "instances_for_model", "instantiate", "known_template",
           "templates"]
