"""Synthetic workloads: a family's definition with random inputs and its reference's outputs.

Used by ``enginetap definitions synth`` and the demo: a dataset to replay that needs no
engine. The "engine outputs" stored are the reference's own, so a replay of it passes by
construction; it exercises the whole path (store, load, trust, compare, timing).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from enginetap import __version__
from enginetap.dataset import Dataset
from enginetap.dataset.schema import Definition, Receipt
from enginetap.definitions.base import Template, compile_reference
from enginetap.errors import DefinitionError
from enginetap.replay.solution import CallPlan

__all__ = ["coerce_values", "synthesize"]


def coerce_values(template: Template, raw: Mapping[str, str]) -> dict[str, Any]:
    """Turn ``--set k=v`` strings into a const axis (int) or a param (its default's type).

    Raises:
        DefinitionError: a value does not parse as its type. Unknown names are passed
            through for :meth:`Template.instantiate` to reject with the full list.
    """
    values: dict[str, Any] = {}
    for key, text in raw.items():
        if key in template.const_axes:
            values[key] = _parse(template, key, text, int)
        elif key in template.params:
            default = template.params[key]
            kind = type(default)
            values[key] = _parse_bool(template, key, text) if kind is bool else \
                _parse(template, key, text, kind)
        else:
            values[key] = text
    return values


def _parse(template: Template, key: str, text: str, kind: type) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise DefinitionError(f"bad value for {template.family}.{key}",
                              f"{text!r} does not parse as {kind.__name__}",
                              f"pass {key}=<{kind.__name__}>") from None


def _parse_bool(template: Template, key: str, text: str) -> bool:
    lowered = text.lower()
    if lowered in {"true", "1", "yes"}:
        return True
    if lowered in {"false", "0", "no"}:
        return False
    raise DefinitionError(f"bad value for {template.family}.{key}",
                          f"{text!r} does not parse as bool",
                          f"pass {key}=true or {key}=false")


def synthesize(dataset: Dataset, template: Template, values: Mapping[str, Any] | None = None,
               *, workloads: int = 2, seed: int = 0) -> Definition:
    """Write ``template``'s definition and ``workloads`` synthetic workloads to ``dataset``.

    ``values`` override the family's example const axes and params. Workload ``i`` uses
    seed ``seed + i`` and the family's example var axes.

    Raises:
        DefinitionError: the values do not instantiate the family, or its reference fails.
        DatasetError: the dataset refuses the definition or a workload.
    """
    definition = template.instantiate(**{**template.example, **(values or {})})
    reference = compile_reference(definition.reference, definition.name)
    plan = CallPlan(definition)
    dataset.write_definition(definition)
    for index in range(workloads):
        inputs = template.synthetic_inputs(definition, template.example_axes, seed + index)
        args, kwargs = plan.prepare(inputs, template.example_axes, "cpu")
        try:
            outputs = plan.collect(reference(*args, **kwargs), args, kwargs)
        except Exception as exc:  # a broken family reference: name it instead of crashing
            raise DefinitionError(f"reference of {definition.name} failed on synthetic inputs",
                                  f"{type(exc).__name__}: {exc}",
                                  f"fix enginetap/definitions/refs/{template.reference}") from exc
        receipt = Receipt(source=f"synthetic:{template.family}", seed=seed + index,
                          created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                          enginetap_version=__version__,
                          notes={"axes": dict(template.example_axes)})
        dataset.add_workload(definition, inputs, outputs=outputs, receipt=receipt)
    return definition
