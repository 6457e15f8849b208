"""Helpers for dataset tests: a small hand-written definition and random tensors."""

from __future__ import annotations

from pathlib import Path

import torch

from enginetap.dataset.schema import AxisConst, AxisVar, Definition, TensorSpec

HIDDEN = 4


def copy_definition(dtype: str = "float32", constraints: tuple[str, ...] = ()) -> Definition:
    """A tiny family of our own (not a registered one): y = x, with three scalar knobs."""
    return Definition(
        name=f"tiny_copy_{dtype}_h{HIDDEN}",
        op_type="tiny_copy",
        axes={"batch": AxisVar(description="rows"), "hidden": AxisConst(value=HIDDEN)},
        inputs={
            "x": TensorSpec(shape=["batch", "hidden"], dtype=dtype),
            "n": TensorSpec(shape=None, dtype="int32"),
            "alpha": TensorSpec(shape=None, dtype="float32"),
            "flag": TensorSpec(shape=None, dtype="bool"),
        },
        outputs={"y": TensorSpec(shape=["batch", "hidden"], dtype=dtype)},
        reference="def run(x, n, alpha, flag):\n    return x.clone()\n",
        constraints=list(constraints),
    )


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random values of any stored dtype (never all zeros)."""
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) < 0.5
    if dtype == torch.float4_e2m1fn_x2:
        raw = torch.randint(1, 256, shape, generator=gen, dtype=torch.uint8)
        return raw.view(torch.float4_e2m1fn_x2)
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        low, high = max(info.min, -1000), min(info.max, 1000)
        return torch.randint(low, high, shape, generator=gen, dtype=dtype)
    return (torch.randn(shape, generator=gen) * 3).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaN-safe, and defined for float8/float4)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_bytes = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return torch.equal(as_bytes(a), as_bytes(b))


def files_under(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if not p.is_dir())
