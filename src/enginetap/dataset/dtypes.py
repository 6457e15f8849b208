"""Dtype names of the schema, as torch and safetensors spell them.

``float4_e2m1`` is stored as ``torch.float4_e2m1fn_x2``, the packed type torch offers and
flashinfer-bench maps it to: each element holds two fp4 values, and a definition's shape
counts these packed elements (flashinfer-bench compares shapes the same way). safetensors
records such a tensor as ``F4`` with the last dimension counted in fp4 values, twice ours.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from enginetap.errors import DatasetError

if TYPE_CHECKING:
    import torch

__all__ = ["from_header", "name_of", "torch_dtype"]

_TORCH_NAMES = {
    "float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
    "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2",
    "float4_e2m1": "float4_e2m1fn_x2",
    "int64": "int64", "int32": "int32", "int16": "int16", "int8": "int8", "bool": "bool",
}
_HEADER_NAMES = {
    "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "F4": "float4_e2m1",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "BOOL": "bool",
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype storing schema dtype ``name``.

    Raises:
        DatasetError: the name is unknown, or this torch build lacks the type.
    """
    import torch

    found = getattr(torch, _TORCH_NAMES.get(name, ""), None)
    if not isinstance(found, torch.dtype):
        raise DatasetError(f"dtype {name!r} is not available",
                           f"torch {torch.__version__} has no type for it",
                           f"use one of {sorted(_TORCH_NAMES)} with a torch that offers it")
    return found


def name_of(dtype: torch.dtype) -> str:
    """The schema name of a torch dtype, or its torch spelling when the schema has none."""
    text = str(dtype).removeprefix("torch.")
    for name, torch_name in _TORCH_NAMES.items():
        if torch_name == text:
            return name
    return text


def from_header(dtype: str, shape: list[int]) -> tuple[str, tuple[int, ...]]:
    """Schema dtype name and torch shape of a tensor as a safetensors header records it."""
    name = _HEADER_NAMES.get(dtype, dtype)
    if name == "float4_e2m1" and shape:
        shape = [*shape[:-1], shape[-1] // 2]
    return name, tuple(shape)
