"""Operator-definition templates: op-type shapes with const axes, instantiated per model.

A :class:`Template` describes one family (say ``gdn_decode``): its axes, inputs, outputs,
how to compare outputs, a synthetic-input generator, and a reference file under
``definitions/refs/``. :meth:`Template.instantiate` binds the const axes (a model's head
counts, hidden size, ...) and returns a FlashInfer-Trace :class:`Definition` whose
``reference`` is self-contained source: a header assigning every const axis and parameter
as a module constant, followed by the family's reference file, which defines ``run``.

enginetap trusts only source it generates itself: ``registry.known_template`` regenerates a
definition from its family tag and const axes and says whether the stored reference is
byte-identical to ours. Which families exist is an explicit list in
:mod:`enginetap.definitions.families`; this module knows none of them.
"""

from __future__ import annotations

import importlib.resources
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from enginetap.dataset.constraints import broken
from enginetap.dataset.schema import AxisConst, AxisVar, Definition, TensorSpec
from enginetap.errors import DefinitionError

if TYPE_CHECKING:
    import torch

__all__ = [
    "FLOAT_DTYPES", "Axis", "CompareRule", "Template", "Tensor", "compile_reference", "const",
    "dtype_param", "family_of", "params_of", "var",
]

FAMILY_TAG = "enginetap:family="
PARAM_TAG = "enginetap:param:"


@dataclass(frozen=True)
class Axis:
    kind: Literal["const", "var"]
    description: str = ""


def const(description: str = "") -> Axis:
    return Axis("const", description)


def var(description: str = "") -> Axis:
    return Axis("var", description)


FLOAT_DTYPES = ("bfloat16", "float16", "float32")
"""The activation dtypes a family's ``dtype`` param may take."""


def dtype_param() -> dict[str, Any]:
    """``params`` and ``choices`` of a family whose one param is its activation ``dtype``
    (bfloat16 unless given): ``Template(..., **dtype_param())``."""
    return {"params": {"dtype": "bfloat16"}, "choices": {"dtype": FLOAT_DTYPES}}


@dataclass(frozen=True)
class Tensor:
    """Shape as axis names (``None`` = scalar) and dtype; the dtype may be ``"{param}"``."""

    shape: tuple[str, ...] | None
    dtype: str
    description: str = ""


@dataclass(frozen=True)
class CompareRule:
    """How replay compares one output.

    ``float``: within ``atol + rtol*|expected|`` (defaults per dtype when ``None``).
    ``exact``: every element equal (integers, bools, anything bit-exact).
    ``selection``: the last dimension is an unordered set of indices (top-k ids); rows are
    compared as sets. With ``scores`` naming an input, an index that differs is still
    accepted when its score ties (within ``atol``) with the score of the index it replaced.

    ``paired_with`` (on a ``float`` or ``exact`` output) names a ``selection`` output whose
    rows index this one (top-k weights beside top-k ids): engines list a row's selection in
    any order, so before comparing, each row of both sides is reordered by its own ids.
    """

    kind: Literal["float", "exact", "selection"] = "float"
    atol: float | None = None
    rtol: float | None = None
    scores: str | None = None
    paired_with: str | None = None


Generator = Callable[[Definition, Mapping[str, int], "torch.Generator", str], dict[str, Any]]
AxesOf = Callable[[Mapping[str, int], int], dict[str, int]]
"""Var axes of synthetic workload ``i`` of an instance, from its const axes."""


@dataclass(frozen=True)
class Template:
    """One operator family; see the module docstring."""

    family: str
    op_type: str
    name: str
    """Name pattern formatted with const axes and params, e.g. ``rmsnorm_h{hidden_size}``."""
    description: str
    axes: Mapping[str, Axis]
    inputs: Mapping[str, Tensor]
    outputs: Mapping[str, Tensor]
    reference: str
    """File name under ``enginetap/definitions/refs/``."""
    generate: Generator
    """Synthetic inputs for given var axes: ``(definition, axes, generator, device)``."""
    compare: Mapping[str, CompareRule] = field(default_factory=dict)
    params: Mapping[str, Any] = field(default_factory=dict)
    """Non-axis parameters with defaults (dtypes, algorithm switches), also header constants."""
    choices: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    """Allowed values of params that take one of a few (dtypes, variants); others are refused."""
    constraints: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()
    engines: tuple[str, ...] = ()
    """Engines here whose kernels this family describes (empty: seed-only family)."""
    example: Mapping[str, Any] = field(default_factory=dict)
    """Const axes (and params) of a small, valid instance: docs, demo and tests use it."""
    example_axes: Mapping[str, int] = field(default_factory=dict)
    """Var-axis values of a small synthetic workload of :attr:`example`."""
    workload_axes: AxesOf | None = None
    """Var axes of synthetic workload ``i`` for given const axes (they vary with ``i``, so a
    dataset's workloads differ in shape, not only in values); ``None``: always
    :attr:`example_axes`."""

    @property
    def const_axes(self) -> list[str]:
        return [k for k, a in self.axes.items() if a.kind == "const"]

    def example_definition(self) -> Definition:
        """The definition of :attr:`example` (small shapes)."""
        return self.instantiate(**self.example)

    def rule(self, output: str) -> CompareRule:
        return self.compare.get(output, CompareRule())

    def axes_for(self, consts: Mapping[str, int], index: int = 0) -> dict[str, int]:
        """Var axes of synthetic workload ``index`` of the instance with const axes ``consts``."""
        if self.workload_axes is None:
            return dict(self.example_axes)
        return self.workload_axes(consts, index)

    def instantiate(self, **values: Any) -> Definition:
        """Bind const axes (and optionally params) and return the Definition.

        Raises:
            DefinitionError: a const axis is missing or not a positive int, or a name is
                neither a const axis nor a param of this family.
        """
        consts, params = self._split_values(values)
        fmt = {**consts, **params}
        return Definition(
            name=self.name.format(**fmt),
            op_type=self.op_type,
            description=self.description,
            axes={k: AxisConst(value=consts[k], description=a.description or None)
                  if a.kind == "const" else AxisVar(description=a.description or None)
                  for k, a in self.axes.items()},
            inputs={k: self._spec(t, params) for k, t in self.inputs.items()},
            outputs={k: self._spec(t, params) for k, t in self.outputs.items()},
            reference=self.reference_source(consts, params),
            tags=[f"{FAMILY_TAG}{self.family}", *self.tags,
                  *(f"{PARAM_TAG}{k}={v}" for k, v in params.items())],
            constraints=list(self.constraints),
        )

    def _split_values(self, values: Mapping[str, Any]) -> tuple[dict[str, int], dict[str, Any]]:
        unknown = sorted(set(values) - set(self.const_axes) - set(self.params))
        missing = sorted(set(self.const_axes) - set(values))
        bad = sorted(k for k in self.const_axes if k in values and not _positive_int(values[k]))
        problems = [f"missing const axes {missing}"] * bool(missing)
        problems += [f"unknown names {unknown}"] * bool(unknown)
        problems += [f"const axes {bad} must be positive integers"] * bool(bad)
        problems += [f"{k}={values[k]!r} is not one of {list(allowed)}"
                     for k, allowed in self.choices.items() if k in values
                     and values[k] not in allowed]
        problems += [f"{k}={values[k]!r} is not a finite number" for k, d in self.params.items()
                     if isinstance(d, float) and k in values and not _finite(values[k])]
        if not problems:
            consts = {k: values[k] for k in self.const_axes}
            problems += [f"the const axes break {rule!r}"
                         for rule in broken(self.constraints, consts)]
        if problems:
            raise DefinitionError(
                f"cannot instantiate {self.family!r}", "; ".join(problems),
                f"give exactly the const axes {self.const_axes} and optionally params "
                f"{sorted(self.params)}")
        consts = {k: int(values[k]) for k in self.const_axes}
        # Params take their default's type, so the header and the tags read back agree
        # (an int 2 given for a float param is written and re-read as 2.0).
        params = {k: _as_type_of(d, values.get(k, d)) for k, d in self.params.items()}
        return consts, params

    @staticmethod
    def _spec(t: Tensor, params: Mapping[str, Any]) -> TensorSpec:
        return TensorSpec(shape=list(t.shape) if t.shape is not None else None,
                          dtype=t.dtype.format(**params), description=t.description or None)

    def reference_source(self, consts: Mapping[str, int], params: Mapping[str, Any]) -> str:
        body = importlib.resources.files("enginetap.definitions.refs").joinpath(self.reference)
        header = [f"# Reference for enginetap family {self.family!r}. "
                  "Constants of this definition:"]
        header += [f"{k} = {v!r}" for k, v in {**consts, **params}.items()]
        return "\n".join(header) + "\n\n" + body.read_text()

    def synthetic_inputs(self, definition: Definition, axes: Mapping[str, int], seed: int = 0,
                         device: str = "cpu") -> dict[str, Any]:
        """Deterministic random inputs (never zeros) for the given var-axis values."""
        import torch

        gen = torch.Generator(device=device).manual_seed(seed)
        return self.generate(definition, axes, gen, device)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError, OverflowError):
        return False


def _as_type_of(default: Any, value: Any) -> Any:
    if isinstance(default, bool) or default is None or isinstance(value, type(default)):
        return value
    try:
        return type(default)(value)
    except (TypeError, ValueError):
        raise DefinitionError(f"parameter value {value!r} is not a {type(default).__name__}",
                              fix=f"pass a {type(default).__name__} like the default {default!r}"
                              ) from None


def family_of(definition: Definition) -> str | None:
    for tag in definition.tags:
        if tag.startswith(FAMILY_TAG):
            return tag[len(FAMILY_TAG):]
    return None


def params_of(definition: Definition, template: Template) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tag in definition.tags:
        if tag.startswith(PARAM_TAG):
            key, _, raw = tag[len(PARAM_TAG):].partition("=")
            if key in template.params:
                default = template.params[key]
                out[key] = type(default)(raw) if not isinstance(default, bool) else raw == "True"
    return out


def compile_reference(source: str, name: str = "<reference>") -> Callable[..., Any]:
    """Execute reference source in a fresh namespace and return its ``run``.

    Only call this on source enginetap generated, or with the user's explicit trust.
    """
    namespace: dict[str, Any] = {"__name__": f"enginetap_reference_{abs(hash(name))}"}
    exec(compile(source, f"<reference {name}>", "exec"), namespace)  # noqa: S102
    run = namespace.get("run")
    if not callable(run):
        raise DefinitionError(f"reference of {name} defines no callable 'run'")
    return run
