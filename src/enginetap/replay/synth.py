"""Synthetic workloads: a family's definition with random inputs and its reference's outputs.

Used by ``enginetap definitions synth`` and the demo: a dataset to replay that needs no
engine. The "engine outputs" stored are the reference's own, so a replay of it passes by
construction; it exercises the whole path (store, load, trust, compare, timing).
"""

from __future__ import annotations

import datetime
import math
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


SIZE_BUDGET = 256 * 2**20
"""Bytes the inputs and outputs of one synthetic workload may take (a typo such as
``hidden_size=10**12`` is refused, not allocated)."""


BATCH = 64
"""Workloads computed, then written, at a time: memory holds one batch, never the whole
synth."""

_SAMPLED = 16
"""Workloads whose sizes estimate a synth's total (their var axes cycle or grow slowly)."""


def synthesize(dataset: Dataset, template: Template, values: Mapping[str, Any] | None = None,
               *, workloads: int = 2, seed: int = 0,
               size_budget: int = SIZE_BUDGET) -> Definition:
    """Write ``template``'s definition and ``workloads`` synthetic workloads to ``dataset``.

    ``values`` override the family's example const axes and params. Workload ``i`` uses
    seed ``seed + i`` and the var axes ``template.axes_for(consts, i)`` (they vary with
    ``i``). Workloads are computed and written :data:`BATCH` at a time, after a check that
    they fit on the disk (:func:`check_room`); a failure at any point removes what this
    call wrote, so a failed synth leaves no definition without workloads.

    Raises:
        DefinitionError: the values do not instantiate the family, a workload would exceed
            ``size_budget`` bytes, the workloads would not fit in the free disk space, or
            the family's generator or reference fails.
        DatasetError: the dataset refuses the definition or a workload.
        OSError: writing failed (what this call wrote is removed first).
    """
    definition = template.instantiate(**{**template.example, **(values or {})})
    check_room(dataset, template, definition, workloads)
    written: list[str] = []
    new = definition.name not in dataset.definitions()
    try:
        dataset.write_definition(definition)
        for start in range(0, workloads, BATCH):
            batch = [_workload(template, definition, seed + i, i, size_budget)
                     for i in range(start, min(start + BATCH, workloads))]
            _write_batch(dataset, definition, batch, written)
    except BaseException:
        if new:  # only what this call created: never another writer's definition
            from enginetap.dataset.paths import definition_relpath, workloads_relpath

            _remove(dataset, [definition_relpath(definition.op_type, definition.name),
                              workloads_relpath(definition.op_type, definition.name),
                              *written])
        raise
    return definition


def check_room(dataset: Dataset, template: Template, definition: Definition,
               workloads: int) -> None:
    """Refuse a synth whose workloads cannot fit in the free space of the dataset's disk
    (their tensors alone, estimated from the largest of the first workloads).

    Raises:
        DefinitionError: the workloads exceed the free space (each one's own budget is
            checked as it is computed).
    """
    import shutil

    sizes = [_check_size(definition, template.axes_for(definition.const_axes, i), math.inf)
             for i in range(min(workloads, _SAMPLED))]
    if max(sizes, default=0) > SIZE_BUDGET:
        return  # each workload is refused on its own, with that reason, as it is computed
    need = max(sizes, default=0) * workloads
    free = shutil.disk_usage(dataset.root).free
    if need > free:
        raise DefinitionError(
            f"{definition.name}: --workloads {workloads} would write about "
            f"{need / 2**30:.1f} GiB of tensors",
            f"the disk holding {dataset.root} has {free / 2**30:.1f} GiB free",
            "ask for fewer workloads")


def _workload(template: Template, definition: Definition, seed: int, index: int,
              size_budget: int) -> tuple[dict[str, Any], dict[str, Any], Receipt]:
    axes = template.axes_for(definition.const_axes, index)
    _check_size(definition, axes, size_budget)
    where = f"{definition.name} (workload {index}, axes {axes})"
    try:
        inputs = template.synthetic_inputs(definition, axes, seed)
        plan = CallPlan(definition)
        args, kwargs = plan.prepare(inputs, axes, "cpu")
        reference = compile_reference(definition.reference, definition.name)
        outputs = plan.collect(reference(*args, **kwargs), args, kwargs)
    except DefinitionError:
        raise
    except Exception as exc:  # a broken generator or reference: name it instead of crashing
        raise DefinitionError(f"synthetic workload of {where} failed",
                              f"{type(exc).__name__}: {exc}",
                              f"fix enginetap/definitions/refs/{template.reference} or the "
                              f"family's generator") from exc
    receipt = Receipt(source=f"synthetic:{template.family}", seed=seed,
                      created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                      enginetap_version=__version__, notes={"axes": dict(axes)})
    return inputs, outputs, receipt


def _check_size(definition: Definition, axes: Mapping[str, int], budget: float) -> int:
    """The bytes of one workload's tensors (refused past ``budget``)."""
    from enginetap.dataset.dtypes import torch_dtype

    total = 0
    for spec in (*definition.inputs.values(), *definition.outputs.values()):
        shape = definition.shape_of(spec, dict(axes)) or ()
        total += math.prod(shape) * torch_dtype(spec.dtype).itemsize
    if total > budget:
        raise DefinitionError(
            f"{definition.name}: a synthetic workload would take {total / 2**20:.1f} MiB",
            f"more than the budget of {budget / 2**20:.0f} MiB for synthetic tensors",
            "choose smaller const axes with --set")
    return total


def _write_batch(dataset: Dataset, definition: Definition,
                 computed: list[tuple[dict[str, Any], dict[str, Any], Receipt]],
                 written: list[str]) -> None:
    """Write one batch of computed workloads, adding each blob written to ``written`` at
    once (so that a failure later in the batch still removes it)."""
    for inputs, outputs, receipt in computed:
        line = dataset.add_workload(definition, inputs, outputs=outputs, receipt=receipt)
        written += _blob_refs(line)


def _blob_refs(line: Any) -> list[str]:
    paths = {v.path for v in line.workload.inputs.values() if getattr(v, "path", None)}
    return sorted(paths)


def _remove(dataset: Dataset, rels: list[str]) -> None:
    for rel in rels:
        try:
            dataset.resolve(rel).unlink(missing_ok=True)
        except OSError:
            continue  # best effort: the original error is what the caller reports
