"""What the dataset refuses, with messages that say what and why, leaving no file behind."""

from __future__ import annotations

import os

import pytest
import torch

from enginetap.dataset.constraints import ConstraintError, evaluate
from enginetap.dataset.schema import AxisConst, AxisVar, Definition, TensorSpec
from enginetap.errors import DatasetError, ProblemsError
from tests.dataset.dataset_helpers import HIDDEN, copy_definition, files_under


def _bad_inputs(gen: torch.Generator) -> dict[str, tuple[dict, dict | None, str]]:
    """Case -> (inputs, outputs, text the refusal must contain)."""
    x = torch.randn(3, HIDDEN, generator=gen)
    ok = {"x": x, "n": 2, "alpha": 0.5, "flag": True}
    return {
        "const axis": ({**ok, "x": torch.randn(3, HIDDEN + 1, generator=gen)}, None,
                       "input 'x' dim 1 (axis 'hidden'): expected 4"),
        "rank": ({**ok, "x": torch.randn(HIDDEN, generator=gen)}, None,
                 "input 'x': expected rank 2"),
        "dtype": ({**ok, "x": x.half()}, None, "input 'x': expected dtype float32, got float16"),
        "missing input": ({k: v for k, v in ok.items() if k != "alpha"}, None,
                          "missing inputs ['alpha']"),
        "extra input": ({**ok, "beta": 1.0}, None, "unknown inputs ['beta']"),
        "tensor for scalar": ({**ok, "n": torch.ones(2, dtype=torch.int32)}, None,
                              "input 'n': expected a scalar"),
        "float for int": ({**ok, "n": 2.5}, None, "input 'n': expected a scalar of dtype int32"),
        "scalar for tensor": ({**ok, "x": 1.0}, None, "input 'x': expected a torch.Tensor"),
        "constraint": ({**ok, "x": torch.randn(8, HIDDEN, generator=gen)}, None,
                       "constraint 'batch % 3 == 0' is false for batch=8"),
        "unknown output": (ok, {"z": x}, "unknown outputs ['z']"),
        "output var axis": (ok, {"y": torch.randn(4, HIDDEN, generator=gen)},
                            "output 'y' dim 0 (axis 'batch'): got 4, but input 'x' dim 0"),
        "output dtype": (ok, {"y": x.double()}, "output 'y': expected dtype float32"),
    }


@pytest.mark.parametrize("case", list(_bad_inputs(torch.Generator())))
def test_bad_workloads_are_refused_before_any_write(dataset, receipt, gen, case):
    inputs, outputs, expected = _bad_inputs(gen)[case]
    definition = copy_definition(constraints=("batch % 3 == 0",))
    with pytest.raises(DatasetError) as info:
        dataset.add_workload(definition, inputs, outputs=outputs, receipt=receipt)
    assert isinstance(info.value, ProblemsError)
    assert any(expected in problem for problem in info.value.problems), info.value.problems
    assert files_under(dataset.root) == []  # not even the definition


def test_every_problem_is_listed_at_once(dataset, receipt, gen):
    inputs = {"x": torch.randn(2, 5, generator=gen).half(), "n": True, "extra": 1}
    with pytest.raises(ProblemsError) as info:
        dataset.add_workload(copy_definition(), inputs, receipt=receipt)
    text = "\n".join(info.value.problems)
    for part in ("missing inputs ['alpha', 'flag']", "unknown inputs ['extra']",
                 "axis 'hidden'): expected 4", "expected dtype float32", "input 'n'"):
        assert part in text
    assert len(info.value.problems) == 5


def test_var_axis_must_agree_across_inputs(dataset, receipt, gen):
    definition = Definition(
        name="tiny_add", op_type="tiny_add", axes={"n": AxisVar(), "d": AxisConst(value=2)},
        inputs={"a": TensorSpec(shape=["n", "d"], dtype="float32"),
                "b": TensorSpec(shape=["n", "d"], dtype="float32")},
        outputs={"c": TensorSpec(shape=["n", "d"], dtype="float32")},
        reference="def run(a, b):\n    return a + b\n")
    a, b = torch.randn(3, 2, generator=gen), torch.randn(4, 2, generator=gen)
    with pytest.raises(DatasetError, match=r"input 'b' dim 0 \(axis 'n'\): got 4, but input "
                                           r"'a' dim 0 \(axis 'n'\) binds it to 3"):
        dataset.add_workload(definition, {"a": a, "b": b}, receipt=receipt)
    assert files_under(dataset.root) == []


def test_var_axis_used_only_by_outputs_is_refused(dataset, receipt, gen):
    definition = Definition(
        name="tiny_expand", op_type="tiny_expand", axes={"n": AxisVar(), "m": AxisVar()},
        inputs={"a": TensorSpec(shape=["n"], dtype="float32")},
        outputs={"b": TensorSpec(shape=["n", "m"], dtype="float32")},
        reference="def run(a):\n    return a[:, None]\n")
    with pytest.raises(DatasetError, match=r"var axes \['m'\] are not bound"):
        dataset.add_workload(definition, {"a": torch.randn(3, generator=gen)},
                             outputs={"b": torch.randn(3, 1, generator=gen)}, receipt=receipt)
    assert files_under(dataset.root) == []


def test_definitions_are_never_overwritten(dataset, receipt, copy_inputs):
    original = copy_definition()
    path = dataset.write_definition(original)
    before = path.read_bytes()
    changed = original.model_copy(update={"description": "something else"})
    with pytest.raises(DatasetError, match="already exists .* with different content"):
        dataset.write_definition(changed)
    with pytest.raises(DatasetError, match="different content"):
        dataset.add_workload(changed, copy_inputs(), receipt=receipt)
    assert path.read_bytes() == before
    assert files_under(dataset.root) == ["definitions/tiny_copy/tiny_copy_float32_h4.json"]


def test_used_uuid_and_existing_blob_are_refused(dataset, receipt, copy_inputs):
    definition = copy_definition()
    dataset.add_workload(definition, copy_inputs(), receipt=receipt, uuid="fixed")
    before = {f: (dataset.root / f).read_bytes() for f in files_under(dataset.root)}
    with pytest.raises(DatasetError, match="uuid 'fixed' is already used"):
        dataset.add_workload(definition, copy_inputs(), receipt=receipt, uuid="fixed")
    # A blob left by a crash (no line) must not be overwritten either.
    orphan = dataset.root / "blob/workloads/tiny_copy/tiny_copy_float32_h4/" \
        "tiny_copy_float32_h4_orphan.safetensors"
    orphan.write_bytes(b"left by a crash")
    before[orphan.relative_to(dataset.root).as_posix()] = orphan.read_bytes()
    with pytest.raises(DatasetError, match="refusing to overwrite"):
        dataset.add_workload(definition, copy_inputs(), receipt=receipt, uuid="orphan")
    assert {f: (dataset.root / f).read_bytes() for f in files_under(dataset.root)} == before


@pytest.mark.parametrize("name", ["a/b", "..", ".hidden", "a b"])
def test_names_that_are_not_file_names_are_refused(dataset, receipt, copy_inputs, name):
    definition = copy_definition().model_copy(update={"name": name})
    with pytest.raises(DatasetError, match="cannot be used in a dataset path"):
        dataset.add_workload(definition, copy_inputs(), receipt=receipt)
    with pytest.raises(DatasetError, match="cannot be used in a dataset path"):
        dataset.add_workload(copy_definition(), copy_inputs(), receipt=receipt, uuid=name)
    assert files_under(dataset.root) == []


def test_resolve_refuses_paths_leaving_the_root(tmp_path, dataset):
    outside = tmp_path / "outside"
    outside.mkdir()
    (dataset.root / "blob").mkdir()
    os.symlink(outside, dataset.root / "blob" / "escape")
    os.symlink(dataset.root / "definitions", dataset.root / "blob" / "inside")
    for bad, why in [("/etc/passwd", "absolute"), ("blob/../../x", "'..'"),
                     ("blob/escape/x.safetensors", "outside the dataset root"),
                     ("", "empty"), ("blob\\x", "backslash")]:
        with pytest.raises(DatasetError, match=why):
            dataset.resolve(bad)
    assert dataset.resolve("blob/inside/a.json") == dataset.root / "definitions/a.json"


def test_loaders_refuse_stored_paths_leaving_the_root(tmp_path, dataset, receipt, copy_inputs):
    line = dataset.add_workload(copy_definition(), copy_inputs(), receipt=receipt)
    blob = dataset.root / line.workload.inputs["x"].path
    (tmp_path / "stolen.safetensors").write_bytes(blob.read_bytes())
    for path in ["../stolen.safetensors", str(tmp_path / "stolen.safetensors")]:
        tampered = line.model_copy(deep=True)
        tampered.workload.inputs["x"].path = path
        with pytest.raises(DatasetError, match="refusing dataset path"):
            dataset.load_inputs(tampered)
        tampered.enginetap.outputs.tensors["y"] = tampered.workload.inputs["x"]
        with pytest.raises(DatasetError, match="refusing dataset path"):
            dataset.load_outputs(tampered)


def test_loaders_refuse_missing_and_mismatched_data(dataset, receipt, copy_inputs):
    line = dataset.add_workload(copy_definition(), copy_inputs(), receipt=receipt)
    wrong_axes = line.model_copy(deep=True)
    wrong_axes.workload.axes["batch"] = 5
    with pytest.raises(DatasetError, match=r"expected shape \[5, 4\] float32, found \[3, 4\]"):
        dataset.load_inputs(wrong_axes)
    no_scalar = line.model_copy(deep=True)
    del no_scalar.workload.inputs["alpha"]
    with pytest.raises(DatasetError, match="input 'alpha'.*it is missing"):
        dataset.load_inputs(no_scalar)
    (dataset.root / line.workload.inputs["x"].path).unlink()
    with pytest.raises(DatasetError, match="cannot load blob/workloads/"):
        dataset.load_inputs(line)


@pytest.mark.parametrize("expression", [
    "__import__('os').system('true')", "batch.real", "[batch][0]", "open", "2 ** 10 ** 10",
    "batch / 0", "lambda: 1",
])
def test_constraints_outside_the_grammar_are_refused(expression):
    with pytest.raises(ConstraintError):
        evaluate(expression, {"batch": 3})


def test_constraints_evaluate_arithmetic_and_logic():
    names = {"q": 32, "kv": 8, "page": 16}
    assert evaluate("q % kv == 0 and 1 <= page <= 128", names)
    assert evaluate("not (q < kv) or kv == 0", names)
    assert evaluate("q // kv * 2 == 8 if page > 1 else False", names)
    assert not evaluate("q - kv * 4 != 0", names)
