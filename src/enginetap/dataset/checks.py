"""Check a workload against its definition before anything is written.

Var axes are bound from the input tensors' shapes (first input that uses an axis wins;
every other use must agree), const axes must equal their value, dtypes must be exactly the
definition's, scalars must be Python values of the right kind, and the definition's
constraints must hold. Outputs may only use const axes and axes the inputs bind.
Every problem is collected, so one refusal lists everything to fix.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from enginetap.dataset.constraints import violations
from enginetap.dataset.dtypes import name_of, torch_dtype
from enginetap.dataset.schema import Definition, TensorSpec
from enginetap.errors import DatasetError, ProblemsError

if TYPE_CHECKING:
    import torch

__all__ = ["CheckedWorkload", "WorkloadProblems", "check_workload", "coerce_scalar"]

Scalar = Union[int, float, bool]


class WorkloadProblems(ProblemsError, DatasetError):
    """Every reason a workload was refused; catchable as DatasetError or ProblemsError."""


@dataclass
class CheckedWorkload:
    """A workload that passed every check, split the way it is stored."""

    axes: dict[str, int]
    """Var-axis values, in definition order."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, Scalar] = field(default_factory=dict)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)


def check_workload(definition: Definition, inputs: Mapping[str, Any],
                   outputs: Mapping[str, Any] | None) -> CheckedWorkload:
    """Check ``inputs`` (and engine ``outputs``) against ``definition``.

    Raises:
        WorkloadProblems: one line per problem, naming the input/output and axis, what was
            expected and what was given.
    """
    checker = _Checker(definition)
    checked = checker.run(inputs, outputs or {})
    if checker.problems:
        raise WorkloadProblems(
            f"refusing workload for definition {definition.name!r}", checker.problems,
            "give exactly the definition's inputs (and only its outputs), with the shapes "
            "its axes imply and its dtypes; nothing was written")
    return checked


class _Checker:
    def __init__(self, definition: Definition) -> None:
        self.definition = definition
        self.consts = definition.const_axes
        self.bound: dict[str, tuple[int, str]] = {}  # var axis -> (value, where it came from)
        self.problems: list[str] = []

    def run(self, inputs: Mapping[str, Any], outputs: Mapping[str, Any]) -> CheckedWorkload:
        self._check_names("input", list(inputs), self.definition.inputs, required=True)
        self._check_names("output", list(outputs), self.definition.outputs, required=False)
        checked = CheckedWorkload(axes={})
        self._inputs(inputs, checked)
        checked.axes = self._bound_axes()
        for name, spec in self.definition.outputs.items():
            if name in outputs and self._tensor(f"output {name!r}", spec, outputs[name], False):
                checked.outputs[name] = outputs[name]
        if not self.problems:
            values = {**self.consts, **checked.axes}
            self.problems += [f"{v}; choose inputs that satisfy it"
                              for v in violations(self.definition.constraints, values)]
        return checked

    def _inputs(self, inputs: Mapping[str, Any], checked: CheckedWorkload) -> None:
        for name, spec in self.definition.inputs.items():
            if name not in inputs:
                continue
            value = inputs[name]
            if spec.shape is None:
                scalar = self._scalar(f"input {name!r}", spec, value)
                if scalar is not None:
                    checked.scalars[name] = scalar
            elif self._tensor(f"input {name!r}", spec, value, bind=True):
                checked.tensors[name] = value

    def _check_names(self, kind: str, given: list[str], specs: Mapping[str, TensorSpec],
                     required: bool) -> None:
        expected = list(specs)
        missing = [n for n in expected if n not in given] if required else []
        extra = [n for n in given if n not in specs]
        if missing:
            self.problems.append(f"missing {kind}s {missing}: the definition's {kind}s are "
                                 f"{expected}; give every one of them")
        if extra:
            self.problems.append(f"unknown {kind}s {extra}: the definition's {kind}s are "
                                 f"{expected}; remove the others")

    def _tensor(self, where: str, spec: TensorSpec, value: Any, bind: bool) -> bool:
        import torch

        axes = spec.shape or []
        if not isinstance(value, torch.Tensor):
            self.problems.append(f"{where}: expected a torch.Tensor of shape {axes} and dtype "
                                 f"{spec.dtype}, got {type(value).__name__}")
            return False
        before = len(self.problems)
        if value.dim() != len(axes):
            self.problems.append(f"{where}: expected rank {len(axes)} (axes {axes}), got rank "
                                 f"{value.dim()} (shape {list(value.shape)})")
        else:
            for dim, (axis, size) in enumerate(zip(axes, value.shape)):
                self._axis(f"{where} dim {dim} (axis {axis!r})", axis, int(size), bind)
        self._dtype(where, spec, value.dtype)
        return len(self.problems) == before

    def _axis(self, where: str, axis: str, size: int, bind: bool) -> None:
        if axis in self.consts:
            if size != self.consts[axis]:
                self.problems.append(f"{where}: expected {self.consts[axis]} (a const axis of "
                                     f"the definition), got {size}")
        elif axis in self.bound:
            value, source = self.bound[axis]
            if size != value:
                self.problems.append(f"{where}: got {size}, but {source} binds it to {value}; "
                                     "every tensor must agree on a var axis")
        elif bind:
            self.bound[axis] = (size, where)
        # An output axis no input binds is reported once, by _bound_axes.

    def _dtype(self, where: str, spec: TensorSpec, given: torch.dtype) -> None:
        try:
            expected = torch_dtype(spec.dtype)
        except DatasetError as exc:
            self.problems.append(f"{where}: {exc}")
            return
        if given != expected:
            self.problems.append(f"{where}: expected dtype {spec.dtype}, got {name_of(given)}; "
                                 f"convert it with .to({expected})")

    def _scalar(self, where: str, spec: TensorSpec, value: Any) -> Scalar | None:
        import torch

        if isinstance(value, torch.Tensor):
            if value.dim() != 0:
                self.problems.append(f"{where}: expected a scalar ({spec.dtype}), got a tensor "
                                     f"of shape {list(value.shape)}")
                return None
            value = value.item()
        scalar, why = coerce_scalar(spec.dtype, value)
        if why:
            self.problems.append(f"{where}: expected a scalar of dtype {spec.dtype}, got {value!r} "
                                 f"({why})")
        return scalar

    def _bound_axes(self) -> dict[str, int]:
        unbound = [a for a in self.definition.var_axes if a not in self.bound]
        if unbound:
            self.problems.append(
                f"var axes {unbound} are not bound: no input tensor uses them (or the inputs "
                "that do were refused); every var axis must appear in an input's shape")
        return {a: self.bound[a][0] for a in self.definition.var_axes if a in self.bound}


def coerce_scalar(dtype: str, value: Any) -> tuple[Scalar | None, str]:
    """The stored form of a scalar of schema ``dtype``, or None and why it is refused.

    bool wants a bool; integer dtypes an int (not a bool); float dtypes a finite int or
    float, stored as float.
    """
    if dtype == "bool":
        return (value, "") if isinstance(value, bool) else (None, "give True or False")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None, f"give a Python {'int' if dtype.startswith('int') else 'float'}"
    if dtype.startswith("int"):
        return (value, "") if isinstance(value, int) else (None, "give a Python int")
    if not math.isfinite(value):
        return None, "JSON cannot store non-finite numbers"
    return float(value), ""
