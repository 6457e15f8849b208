"""Mismatch dumps as safetensors (the comparison itself lives in
:mod:`enginetap.core.tensors`, shared with capture and tap)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from enginetap.core.tensors import Difference, compare_bits, flatten, summarize

__all__ = ["Difference", "compare_bits", "dump_mismatch", "flatten", "summarize"]


def dump_mismatch(directory: str | Path, name: str, *, inputs: list[tuple[str, Any]],
                  stock: list[tuple[str, Any]], patched: list[tuple[str, Any]],
                  differences: list[Difference], meta: dict[str, str]) -> Path:
    """Write inputs and both outputs of one mismatch as one safetensors file; returns it.

    Tensors are stored under ``input.*``, ``stock.*`` and ``patched.*``; non-tensor inputs
    and the differences go into the file's metadata as JSON.

    Raises:
        OSError: the directory cannot be created or the file cannot be written.
    """
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, str] = {}
    for prefix, leaves in (("input", inputs), ("stock", stock), ("patched", patched)):
        for path, leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                # A private copy: outputs may alias inputs, and safetensors refuses shared storage.
                tensors[f"{prefix}.{path}"] = leaf.detach().to("cpu", copy=True).contiguous()
            else:
                scalars[f"{prefix}.{path}"] = repr(leaf)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"{name}.safetensors"
    metadata = dict(meta, scalars=json.dumps(scalars),
                    differences=json.dumps([asdict(d) for d in differences]))
    save_file(tensors, str(target), metadata=metadata)
    return target
