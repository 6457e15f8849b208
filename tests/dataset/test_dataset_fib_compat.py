"""A dataset we write is a flashinfer-bench dataset: its own loader reads the same data."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

pytest.importorskip("flashinfer_bench.data", reason="flashinfer-bench is not installed")

from flashinfer_bench.bench.utils import load_safetensors  # noqa: E402
from flashinfer_bench.data import SafetensorsInput, ScalarInput, TraceSet  # noqa: E402

from enginetap.dataset.schema import AxisConst, AxisVar, Definition, TensorSpec
from tests.dataset.dataset_helpers import copy_definition, random_tensor, same_bits


def _gather_definition() -> Definition:
    return Definition(
        name="tiny_gather_h8", op_type="tiny_gather",
        axes={"tokens": AxisVar(), "rows": AxisVar(), "hidden": AxisConst(value=8)},
        inputs={"table": TensorSpec(shape=["rows", "hidden"], dtype="bfloat16"),
                "ids": TensorSpec(shape=["tokens"], dtype="int32"),
                "scale": TensorSpec(shape=None, dtype="float32")},
        outputs={"out": TensorSpec(shape=["tokens", "hidden"], dtype="bfloat16")},
        reference="def run(table, ids, scale):\n    return table[ids.long()] * scale\n",
        constraints=["rows >= 1"])


def test_trace_set_loads_what_we_write(dataset, receipt, gen):
    gather, copy = _gather_definition(), copy_definition("float8_e4m3fn")
    written = {}
    for tokens, rows in [(5, 3), (2, 9)]:
        table = random_tensor((rows, 8), torch.bfloat16, gen)
        ids = torch.randint(0, rows, (tokens,), generator=gen, dtype=torch.int32)
        out = table[ids.long()] * 0.5
        line = dataset.add_workload(gather, {"table": table, "ids": ids, "scale": 0.5},
                                    outputs={"out": out}, receipt=receipt)
        written[line.workload.uuid] = line
    x = random_tensor((4, 4), torch.float8_e4m3fn, gen)
    line = dataset.add_workload(copy, {"x": x, "n": 1, "alpha": 2.0, "flag": True},
                                receipt=receipt)
    written[line.workload.uuid] = line

    traces = TraceSet.from_path(str(dataset.root))
    assert set(traces.definitions) == {gather.name, copy.name}
    for ours in (gather, copy):
        theirs = traces.definitions[ours.name]
        assert theirs.model_dump(mode="json") == ours.model_dump(mode="json")
    assert [t.workload.uuid for t in traces.workloads[gather.name]] == list(written)[:2]
    for trace in (t for ts in traces.workloads.values() for t in ts):
        assert trace.is_workload_trace()
        _same_tensors(dataset, traces.definitions[trace.definition], trace.workload,
                      written[trace.workload.uuid])


def _same_tensors(dataset, fib_definition, fib_workload, line) -> None:
    ours = dataset.load_inputs(line)
    # flashinfer-bench's own loader checks shapes and dtypes against its definition.
    theirs = load_safetensors(fib_definition, fib_workload, dataset.root)
    for name, spec in fib_workload.inputs.items():
        if isinstance(spec, ScalarInput):
            assert spec.value == ours[name]
            continue
        assert isinstance(spec, SafetensorsInput)
        direct = safetensors.torch.load_file(dataset.root / spec.path)[spec.tensor_key]
        assert same_bits(direct, ours[name]) and same_bits(theirs[name], ours[name])
    assert fib_definition.get_axes_values_from_inputs(ours.values()) == fib_workload.axes
    # Engine outputs sit in the same blob, under keys flashinfer-bench never asks for.
    outputs = dataset.load_outputs(line)
    for name, ref in (line.enginetap.outputs.tensors.items() if line.enginetap else []):
        direct = safetensors.torch.load_file(dataset.root / ref.path)[ref.tensor_key]
        assert ref.tensor_key == f"enginetap_output:{name}" and same_bits(direct, outputs[name])
