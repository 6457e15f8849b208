"""Which reference a replayed definition runs, decided before any workload: enginetap's
own regenerated source for a definition byte-identical to what its family generates, the
dataset's stored source only when the caller trusts it (``--trust-dataset-code``), else
REFUSED. Either runs in the child process for trusted references."""

from __future__ import annotations

from dataclasses import dataclass

from enginetap import __version__
from enginetap.core.isolated import Child, one_line
from enginetap.dataset.schema import Definition
from enginetap.definitions.base import (
    CompareRule,
    Template,
    compile_reference,
    family_of,
    params_of,
)
from enginetap.definitions.registry import known_template, templates
from enginetap.replay.compare import fallback_rule
from enginetap.replay.execution import ChildFunction, FunctionFailed
from enginetap.replay.results import DefinitionResult, ReplayOptions

__all__ = ["TRUST_FLAG", "Reference", "load_reference"]

TRUST_FLAG = "--trust-dataset-code"


@dataclass
class Reference:
    run: ChildFunction
    rules: dict[str, CompareRule]
    source: str


def resolve_reference(definition: Definition, options: ReplayOptions,
                       trusted: Child) -> Reference | str:
    """The reference to run for ``definition``, or the reason it is refused.

    It runs in the child process ``trusted``, like a candidate: enginetap's regenerated
    source, or the dataset's own when trusted.

    Raises:
        DefinitionError: enginetap's regenerated source defines no ``run``.
        FunctionFailed: the trusted source cannot be loaded (it raised or ended its process).
    """
    template = known_template(definition)
    if template is not None:
        ours = template.instantiate(**definition.const_axes, **params_of(definition, template))
        # Constraints decide which workloads are valid: edited ones make it foreign too.
        if ours.constraints == definition.constraints:
            compile_reference(ours.reference, definition.name)  # ours must define run
            return Reference(_started(ChildFunction(trusted, reference=ours.reference,
                                                     name=definition.name), options),
                              compare_rules(definition, template), "enginetap")
    family = templates().get(family_of(definition) or "")
    if not options.trust_dataset_code:
        why = (f"its reference differs from what enginetap {__version__} generates for family "
               f"{family.family!r} (edited, or made by another enginetap version)"
               if family is not None else "its reference is not from a known enginetap family")
        return f"{why}; dataset code runs only with {TRUST_FLAG}"
    run = ChildFunction(trusted, reference=definition.reference, name=definition.name)
    return Reference(_started(run, options), compare_rules(definition, family), "dataset")


def _started(run: ChildFunction, options: ReplayOptions) -> ChildFunction:
    try:
        run.start(options.timeout)
    except BaseException:
        run.close()
        raise
    return run


def load_reference(definition: Definition, options: ReplayOptions,
                    trusted: Child) -> Reference | DefinitionResult:
    """The reference to run, or the REFUSED/ERROR result of the whole definition."""
    try:
        reference = resolve_reference(definition, options, trusted)
    except FunctionFailed as exc:
        return DefinitionResult(name=definition.name, status="ERROR",
                                message=f"its reference cannot be loaded: {exc}")
    except Exception as exc:  # e.g. a known family's regenerated source: report, go on
        return DefinitionResult(name=definition.name, status="ERROR",
                                message=f"its reference cannot be loaded: {one_line(exc)}")
    if isinstance(reference, str):
        return DefinitionResult(name=definition.name, status="REFUSED", message=reference)
    return reference


def compare_rules(definition: Definition, template: Template | None) -> dict[str, CompareRule]:
    from enginetap.dataset.dtypes import torch_dtype

    rules = {}
    for name, spec in definition.outputs.items():
        if template is not None and name in template.outputs:
            rules[name] = template.rule(name)
        else:
            rules[name] = fallback_rule(torch_dtype(spec.dtype))
    return rules
