"""The FlashInfer-Trace schema, as enginetap reads and writes it.

Field names follow flashinfer-bench's ``flashinfer_bench.data`` models exactly, so its
``TraceSet.from_path`` loads what we write. Our additions live where its models ignore
unknown keys: one extra top-level key ``"enginetap"`` on each workload line, holding the
engine's captured outputs (:class:`EngineOutputs`) and the provenance :class:`Receipt`.

A stored definition is untrusted, so what one may hold is capped: its reference source
(:data:`MAX_REFERENCE_CHARS`), and its constraints (count, length, size and nesting, see
:mod:`enginetap.dataset.constraints`). A definition beyond a cap does not validate.
"""

from __future__ import annotations

import ast
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from enginetap.core.pysource import parse as parse_source
from enginetap.dataset.constraints import MAX_CONSTRAINTS, ConstraintError, parse, quote

NonEmpty = Annotated[str, Field(min_length=1)]
DTypeName = Literal[
    "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float4_e2m1",
    "int64", "int32", "int16", "int8", "bool",
]

MAX_REFERENCE_CHARS = 1 << 20
"""Longest reference source accepted (enginetap's own are a few KiB)."""

__all__ = [
    "MAX_REFERENCE_CHARS", "AxisConst", "AxisVar", "Definition", "DTypeName", "EngineOutputs",
    "EnginetapExtra", "InputSpec", "RandomInput", "Receipt", "SafetensorsInput", "ScalarInput", "TensorSpec",
    "Workload", "WorkloadLine",
]


class _Model(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)


class AxisConst(_Model):
    """An axis whose value is fixed by the definition (a model constant)."""

    type: Literal["const"] = "const"
    value: Annotated[int, Field(ge=0)]
    """The axis length."""
    description: str | None = None


class AxisVar(_Model):
    """An axis whose value each workload binds from its input shapes."""

    type: Literal["var"] = "var"
    description: str | None = None


class TensorSpec(_Model):
    """Shape (axis names; ``None`` for a scalar) and dtype of one input or output."""

    shape: list[NonEmpty] | None
    dtype: DTypeName
    description: str | None = None


class Definition(_Model):
    """An engine-independent operator definition with a PyTorch reference ``run``."""

    name: NonEmpty
    """Unique name, FlashInfer style, e.g. ``gdn_decode_qk16_v32_d128``."""
    op_type: NonEmpty
    """The operator family, e.g. ``rmsnorm``, ``gqa_paged``, ``mla_paged``, ``moe``."""
    axes: dict[NonEmpty, Annotated[Union[AxisConst, AxisVar], Field(discriminator="type")]]
    inputs: dict[NonEmpty, TensorSpec]
    """Inputs in call order."""
    outputs: dict[NonEmpty, TensorSpec]
    """Outputs in return order."""
    reference: NonEmpty
    """Self-contained Python source defining a top-level ``run``."""
    tags: list[NonEmpty] = Field(default_factory=list)
    description: str | None = None
    constraints: list[NonEmpty] = Field(default_factory=list)
    """Python expressions over axis names that every workload must satisfy."""

    @model_validator(mode="after")
    def _validate_reference(self) -> Definition:
        if len(self.reference) > MAX_REFERENCE_CHARS:
            raise ValueError(f"reference: {len(self.reference)} characters, more than the "
                             f"limit of {MAX_REFERENCE_CHARS}")
        try:
            tree = parse_source(self.reference)
        except SyntaxError as exc:
            raise ValueError(f"reference: not valid Python ({exc.msg}, line {exc.lineno})"
                             ) from None
        except (MemoryError, RecursionError):  # CPython's parser gives up on deep nesting
            raise ValueError("reference: nested too deeply to parse") from None
        if not any(isinstance(n, ast.FunctionDef) and n.name == "run" for n in tree.body):
            raise ValueError("reference: must define a top-level function 'run'")
        return self

    @model_validator(mode="after")
    def _validate_names(self) -> Definition:
        overlap = set(self.inputs) & set(self.outputs)
        if overlap:
            raise ValueError(f"outputs: names {sorted(overlap)} are also inputs")
        for kind, specs in (("inputs", self.inputs), ("outputs", self.outputs)):
            for name, spec in specs.items():
                missing = [a for a in spec.shape or [] if a not in self.axes]
                if missing:
                    raise ValueError(f"{kind}.{name}: shape uses undefined axes {missing}")
        return self

    @model_validator(mode="after")
    def _validate_constraints(self) -> Definition:
        if len(self.constraints) > MAX_CONSTRAINTS:
            raise ValueError(f"constraints: {len(self.constraints)} of them, more than the "
                             f"limit of {MAX_CONSTRAINTS}")
        for index, expression in enumerate(self.constraints):
            try:
                parse(expression)
            except ConstraintError as exc:
                raise ValueError(f"constraints.{index}: {quote(expression)}: {exc}") from None
        return self

    @property
    def const_axes(self) -> dict[str, int]:
        return {k: a.value for k, a in self.axes.items() if isinstance(a, AxisConst)}

    @property
    def var_axes(self) -> list[str]:
        return [k for k, a in self.axes.items() if isinstance(a, AxisVar)]

    def shape_of(self, spec: TensorSpec, axes: dict[str, int]) -> tuple[int, ...] | None:
        """Concrete shape of ``spec`` given the workload's var-axis values."""
        if spec.shape is None:
            return None
        values = {**self.const_axes, **axes}
        return tuple(values[a] for a in spec.shape)


class RandomInput(_Model):
    type: Literal["random"] = "random"


class ScalarInput(_Model):
    type: Literal["scalar"] = "scalar"
    value: Union[int, float, bool]


class SafetensorsInput(_Model):
    type: Literal["safetensors"] = "safetensors"
    path: NonEmpty
    """Relative to the dataset root."""
    tensor_key: NonEmpty


InputSpec = Annotated[Union[RandomInput, SafetensorsInput, ScalarInput], Field(discriminator="type")]


class Workload(_Model):
    """Concrete var-axis values and where each input's data lives."""

    axes: dict[str, Annotated[int, Field(ge=0)]]
    inputs: dict[str, InputSpec]
    uuid: NonEmpty


class Receipt(_Model):
    """Provenance of one captured workload: where, when and from what it came."""

    model_config = ConfigDict(extra="allow", use_attribute_docstrings=True)

    source: NonEmpty
    """Who produced it: ``capture:<engine>``, ``synthetic:<generator>``, ``manual``."""
    created_at: NonEmpty
    """ISO-8601 UTC timestamp."""
    engine: str | None = None
    engine_version: str | None = None
    model: str | None = None
    request_ids: list[str] = Field(default_factory=list)
    step: int | None = None
    mode: str | None = None
    """``prefill``, ``decode`` or ``mixed``."""
    layer: str | None = None
    rank: int | None = None
    world_size: int | None = None
    seed: int | None = None
    enginetap_version: str | None = None
    notes: dict[str, Any] = Field(default_factory=dict)


class EngineOutputs(_Model):
    """What the engine really produced for this workload's inputs, by output name."""

    tensors: dict[str, SafetensorsInput] = Field(default_factory=dict)


class EnginetapExtra(_Model):
    """enginetap's additions to a workload line (ignored by flashinfer-bench)."""

    outputs: EngineOutputs = Field(default_factory=EngineOutputs)
    receipt: Receipt


class WorkloadLine(_Model):
    """One line of ``workloads/<op_type>/<name>.jsonl``: a flashinfer-bench workload trace."""

    definition: NonEmpty
    workload: Workload
    solution: None = None
    evaluation: None = None
    enginetap: EnginetapExtra | None = None
