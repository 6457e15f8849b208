"""Bit-for-bit comparison and safetensors mismatch dumps."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from enginetap.guard.bits import compare_bits, dump_mismatch, flatten


def _diff(a, b):
    return compare_bits(flatten(a), flatten(b))


def test_identical_values_compare_equal():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 7, generator=g).to(torch.bfloat16)
    assert _diff((x, None, [x.clone(), 3]), (x.clone(), None, [x, 3])) == []
    assert _diff(x[:, ::2], x.clone()[:, ::2].contiguous()) == []  # layout is not compared


def test_signed_zero_and_nan_payloads_count_as_different():
    zero = torch.tensor([0.0, 1.0])
    (d,) = _diff(zero, torch.tensor([-0.0, 1.0]))
    assert (d.differing, d.numel, d.max_abs) == (1, 2, 0.0)
    quiet = torch.tensor([math.nan], dtype=torch.float32)
    payload = quiet.view(torch.int32).add(1).view(torch.float32)
    assert torch.isnan(payload).all()
    (d,) = _diff(quiet, payload)
    assert d.differing == 1 and math.isnan(d.max_abs)
    assert _diff(2.0, -0.0 + 2.0) == [] and len(_diff(0.0, -0.0)) == 1


def test_dtype_shape_type_and_structure_mismatches():
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(2))
    assert "dtype" in _diff(x, x.double())[0].reason
    assert "shape" in _diff(x, x.reshape(3, 4))[0].reason
    assert "Tensor vs NoneType" in _diff(x, None)[0].reason
    assert "structure" in _diff((x, x), (x,))[0].reason
    assert _diff(True, 1)[0].reason == "bool vs int"


def test_difference_counts_and_max_abs():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(64, generator=g)
    b = a.clone()
    b[[3, 9, 40]] += torch.tensor([0.5, -2.0, 1e-3])
    (d,) = _diff(a, b)
    assert d.differing == 3 and d.max_abs == pytest.approx(2.0)
    complex_a = torch.randn(4, dtype=torch.complex64, generator=g)
    assert len(_diff(complex_a, complex_a.conj())) == 1


def test_dump_is_safetensors_with_inputs_outputs_and_metadata(tmp_path):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 8, generator=g)
    stock, patched = x * 2, x * 2 + 1
    path = dump_mismatch(tmp_path / "dumps", "op-rank0",
                         inputs=flatten({"x": x, "eps": 1e-6}, "args"),
                         stock=flatten(stock), patched=flatten(patched),
                         differences=_diff(stock, patched), meta={"op": "op"})
    assert path.read_bytes()[8:9] == b"{"  # safetensors: u64 header length, then JSON
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == ["input.args.x", "patched.out", "stock.out"]
        assert torch.equal(f.get_tensor("input.args.x"), x)
        assert torch.equal(f.get_tensor("patched.out"), patched)
        meta = f.metadata()
    assert meta["op"] == "op" and json.loads(meta["scalars"]) == {"input.args.eps": "1e-06"}
    assert json.loads(meta["differences"])[0]["differing"] == 24
