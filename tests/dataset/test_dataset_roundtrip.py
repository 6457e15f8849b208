"""What add_workload stores comes back bit for bit, through a freshly opened Dataset."""

from __future__ import annotations

import pytest
import torch

from enginetap.dataset import Dataset
from enginetap.dataset.dtypes import torch_dtype
from enginetap.dataset.schema import AxisVar, Definition, ScalarInput, TensorSpec
from enginetap.errors import DatasetError
from tests.dataset.dataset_helpers import (
    HIDDEN, copy_definition, files_under, random_tensor, same_bits,
)

DTYPES = ["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float4_e2m1",
          "int64", "int32", "int16", "int8", "bool"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_is_bit_exact(dataset, receipt, gen, dtype):
    definition = copy_definition(dtype)
    stored = torch_dtype(dtype)
    x = random_tensor((5, HIDDEN), stored, gen)
    y = random_tensor((5, HIDDEN), stored, gen)
    inputs = {"x": x, "n": -3, "alpha": 0.1, "flag": False}
    line = dataset.add_workload(definition, inputs, outputs={"y": y}, receipt=receipt)

    reopened = Dataset(dataset.root)
    assert reopened.definition(definition.name) == definition
    [back] = reopened.workloads(definition.name)
    assert back == line
    assert back.workload.axes == {"batch": 5}
    loaded = reopened.load_inputs(back)
    assert list(loaded) == ["x", "n", "alpha", "flag"]
    assert same_bits(loaded["x"], x)
    assert (type(loaded["n"]), loaded["n"]) == (int, -3)
    assert (type(loaded["alpha"]), loaded["alpha"]) == (float, 0.1)
    assert (type(loaded["flag"]), loaded["flag"]) == (bool, False)
    outputs = reopened.load_outputs(back)
    assert list(outputs) == ["y"] and same_bits(outputs["y"], y)


def test_workloads_keep_order_and_variants(dataset, receipt, copy_inputs):
    definition = copy_definition()
    batches = [2, 7, 2, 1]
    sent = [copy_inputs(batch=b) for b in batches]
    lines = [dataset.add_workload(definition, inputs, receipt=receipt) for inputs in sent]
    back = Dataset(dataset.root).workloads(definition.name)
    assert [w.workload.uuid for w in back] == [w.workload.uuid for w in lines]
    assert [w.workload.axes["batch"] for w in back] == batches
    for line, inputs in zip(back, sent):
        assert same_bits(dataset.load_inputs(line)["x"], inputs["x"])
        assert dataset.load_outputs(line) == {}
    assert len({w.workload.uuid for w in back}) == 4
    assert all(len(w.workload.uuid) == 32 for w in back)  # uuid4 hex


def test_views_and_strided_tensors_are_stored_as_their_values(dataset, receipt, gen):
    definition = Definition(
        name="tiny_pair", op_type="tiny_pair", axes={"m": AxisVar(), "k": AxisVar()},
        inputs={"a": TensorSpec(shape=["m", "k"], dtype="float32"),
                "b": TensorSpec(shape=["k", "m"], dtype="float32")},
        outputs={"c": TensorSpec(shape=["m", "m"], dtype="float32")},
        reference="def run(a, b):\n    return a @ b\n")
    buffer = torch.randn(6, 3, generator=gen)
    a, b = buffer, buffer.t()  # one storage, b not contiguous
    c = a @ b
    line = dataset.add_workload(definition, {"a": a, "b": b}, outputs={"c": c[:, :]},
                                receipt=receipt)
    loaded = dataset.load_inputs(line)
    assert same_bits(loaded["a"], a) and same_bits(loaded["b"], b.contiguous())
    assert loaded["b"].is_contiguous()
    assert same_bits(dataset.load_outputs(line)["c"], c)


def test_scalar_only_workload_writes_no_blob(dataset, receipt):
    definition = Definition(
        name="tiny_scalar", op_type="tiny_scalar", axes={},
        inputs={"eps": TensorSpec(shape=None, dtype="float32"),
                "k": TensorSpec(shape=None, dtype="int64")},
        outputs={"out": TensorSpec(shape=None, dtype="float32")},
        reference="def run(eps, k):\n    return eps * k\n")
    line = dataset.add_workload(definition, {"eps": torch.tensor(0.5), "k": 3}, receipt=receipt)
    assert line.workload.inputs["eps"] == ScalarInput(value=0.5)
    assert not any(f.startswith("blob/") for f in files_under(dataset.root))
    assert dataset.load_inputs(line) == {"eps": 0.5, "k": 3}


def test_definitions_write_once_and_read_back(dataset):
    first, second = copy_definition("float32"), copy_definition("bfloat16")
    path = dataset.write_definition(first)
    before = path.read_bytes()
    assert dataset.write_definition(first) == path  # identical: a no-op
    assert path.read_bytes() == before
    dataset.write_definition(second)
    assert Dataset(dataset.root).definitions() == {first.name: first, second.name: second}
    assert path == dataset.root / "definitions/tiny_copy/tiny_copy_float32_h4.json"


def test_open_and_lookup_errors_are_clear(tmp_path, dataset):
    with pytest.raises(DatasetError, match="does not exist"):
        Dataset(tmp_path / "missing")
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(DatasetError, match="not a directory"):
        Dataset(tmp_path / "file")
    dataset.write_definition(copy_definition())
    with pytest.raises(DatasetError, match=r"unknown definition 'nope'.*tiny_copy_float32_h4"):
        dataset.definition("nope")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_loads_onto_a_device(dataset, receipt, copy_inputs):
    inputs = copy_inputs()
    line = dataset.add_workload(copy_definition(), inputs, outputs={"y": inputs["x"]},
                                receipt=receipt)
    loaded = dataset.load_inputs(line, device="cuda")
    assert loaded["x"].is_cuda and same_bits(loaded["x"].cpu(), inputs["x"])
    assert dataset.load_outputs(line, device="cuda")["y"].is_cuda


def test_blob_layout_is_safetensors_own_byte_for_byte():
    """The writer lays blobs out itself (header, then each tensor's memory, one writev):
    the file must be exactly the one safetensors writes, for every dtype it knows, empty
    and 0-d tensors included; other dtypes go to safetensors itself."""
    import random

    import safetensors.torch

    from enginetap.dataset.blobs import blob_chunks, host_tensors

    dtypes = [torch.bool, torch.uint8, torch.int8, torch.float8_e5m2, torch.float8_e4m3fn,
              torch.int16, torch.float16, torch.bfloat16, torch.int32, torch.float32,
              torch.float64, torch.int64, torch.float4_e2m1fn_x2]
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    compared = 0
    for _ in range(150):
        named = {}
        for i in range(rng.randint(1, 8)):
            dtype = rng.choice(dtypes)
            shape = [rng.randint(0, 5) for _ in range(rng.randint(1 if dtype ==
                     torch.float4_e2m1fn_x2 else 0, 3))]
            count = int(torch.tensor(shape).prod()) if shape else 1
            raw = torch.randint(0, 256, (count * dtype.itemsize,), dtype=torch.uint8,
                                generator=gen)
            if dtype == torch.bool:
                raw = raw % 2
            named[f"{rng.choice('abcxyz')}{i}"] = raw.view(dtype).reshape(shape)
        chunks = blob_chunks(host_tensors(named))
        assert chunks is not None
        assert b"".join(bytes(c) for c in chunks) == safetensors.torch.save(named)
        compared += 1
    assert compared == 150
    assert blob_chunks({"x": torch.zeros(2, dtype=torch.complex64)}) is None
    assert blob_chunks({"x": torch.zeros((), dtype=torch.uint8).view(
        torch.float4_e2m1fn_x2)}) is None
