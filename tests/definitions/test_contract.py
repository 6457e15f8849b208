"""The contract every registered family keeps, checked once for all of them.

Family-specific numerics live in each family's own test file; this file checks what any
family must do: its example instantiates to a valid Definition that survives JSON, is
recognised as enginetap's own, gets deterministic non-trivial synthetic inputs of the
declared dtypes, and its reference returns the declared output shapes and dtypes.
"""

from __future__ import annotations

import pytest
import torch

from enginetap.dataset.dtypes import torch_dtype
from enginetap.dataset.schema import Definition
from enginetap.definitions import compile_reference, known_template, templates
from enginetap.errors import DefinitionError

FAMILIES = sorted(templates())


def test_every_family_module_registered_something():
    assert len(FAMILIES) >= 17


@pytest.mark.parametrize("family", FAMILIES)
def test_family_contract(family: str) -> None:
    template = templates()[family]
    definition = template.example_definition()
    assert Definition.model_validate_json(definition.model_dump_json()) == definition
    assert known_template(definition) is template
    axes = dict(template.example_axes)
    inputs = template.synthetic_inputs(definition, axes, seed=3)
    again = template.synthetic_inputs(definition, axes, seed=3)
    other = template.synthetic_inputs(definition, axes, seed=4)
    assert list(inputs) == list(definition.inputs)
    changed = False
    for name, value in inputs.items():
        spec = definition.inputs[name]
        if spec.shape is None:
            assert value == again[name], name
            continue
        assert value.dtype == torch_dtype(spec.dtype), name
        assert tuple(value.shape) == definition.shape_of(spec, axes), name
        assert torch.equal(value.view(torch.uint8), again[name].view(torch.uint8)), name
        assert value.view(torch.uint8).ne(0).any(), f"{name} is all zeros"
        changed |= not torch.equal(value.view(torch.uint8), other[name].view(torch.uint8))
    assert changed, "another seed gave the same inputs"
    outputs = compile_reference(definition.reference, definition.name)(**inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    assert len(outputs) == len(definition.outputs)
    for out, (name, spec) in zip(outputs, definition.outputs.items()):
        assert tuple(out.shape) == definition.shape_of(spec, axes), name
        assert out.dtype == torch_dtype(spec.dtype), name
        if out.is_floating_point():
            assert not out.isnan().any(), f"{name} has NaN"


@pytest.mark.parametrize("family", FAMILIES)
def test_the_name_determines_every_param(family: str) -> None:
    """Two instances that differ in any const axis or param get different names."""
    template = templates()[family]
    base = template.example_definition().name
    for key, default in template.params.items():
        allowed = template.choices.get(key) or (
            (not default,) if isinstance(default, bool) else (default * 2 + 1,))
        for value in allowed:
            if value != default:
                changed = template.instantiate(**{**template.example, key: value})
                assert changed.name != base, (key, value)


def _alternatives(value: int) -> list[int]:
    return sorted({1, 2, 3, 4, value + 1, value * 2} - {value})


@pytest.mark.parametrize("family", FAMILIES)
def test_every_legal_const_axis_value_synthesizes(family: str) -> None:
    """Each const axis, moved alone to other values: instantiate refuses it (a constraint
    says why) or it synthesizes workloads whose reference runs."""
    template = templates()[family]
    tried = 0
    for axis in template.const_axes:
        for value in _alternatives(template.example[axis]):
            try:
                definition = template.instantiate(**{**template.example, axis: value})
            except DefinitionError:
                continue
            run = compile_reference(definition.reference, definition.name)
            for index in range(2):
                axes = template.axes_for(definition.const_axes, index)
                run(**template.synthetic_inputs(definition, axes, seed=index))
            tried += 1
    assert tried > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_workloads_vary_their_var_axes(family: str) -> None:
    template = templates()[family]
    consts = template.example_definition().const_axes
    shapes = {tuple(sorted(template.axes_for(consts, i).items())) for i in range(4)}
    assert len(shapes) > 1
