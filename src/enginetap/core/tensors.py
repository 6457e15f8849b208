"""Tensor helpers shared by guard, capture and tap: flatten, bit comparison, clones.

Outputs are flattened into ``(path, leaf)`` pairs (``out``, ``out[0]``, ``arg.x`` …) so a
tensor, a tuple or list of tensors, ``None`` and plain scalars compare the same way.
Tensors are compared through an integer view of their bytes: NaN payloads differ, ``-0.0``
differs from ``0.0``, and dtype and shape must match. Strides are not compared: a caller
reads values, not layout.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Difference", "capturing", "clone_tree", "compare_bits", "flatten", "holds_tensor",
           "summarize"]

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Difference:
    """How one output leaf differs; ``differing`` is -1 where elements cannot be paired."""

    path: str
    reason: str
    differing: int = -1
    numel: int = 0
    max_abs: float = math.nan

    def __str__(self) -> str:
        if self.differing < 0:
            return f"{self.path}: {self.reason}"
        return (f"{self.path}: {self.differing}/{self.numel} elements differ, "
                f"max abs diff {self.max_abs:.4g}")


def flatten(value: Any, path: str = "out") -> list[tuple[str, Any]]:
    """``(path, leaf)`` pairs of a nested tuple / list / dict of tensors and scalars."""
    if isinstance(value, (tuple, list)):
        return [pair for i, item in enumerate(value) for pair in flatten(item, f"{path}[{i}]")]
    if isinstance(value, Mapping):
        return [pair for k in sorted(value, key=str) for pair in flatten(value[k], f"{path}.{k}")]
    return [(path, value)]


def compare_bits(stock: list[tuple[str, Any]], patched: list[tuple[str, Any]]) -> list[Difference]:
    """Every difference between two flattened outputs; empty when they are bit-identical."""
    if [p for p, _ in stock] != [p for p, _ in patched]:
        return [Difference("out", f"structure differs: {[p for p, _ in stock]} vs "
                                  f"{[p for p, _ in patched]}")]
    found = (_compare_leaf(path, a, b) for (path, a), (_, b) in zip(stock, patched))
    return [d for d in found if d is not None]


def _compare_leaf(path: str, a: Any, b: Any) -> Difference | None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return Difference(path, f"{type(a).__name__} vs {type(b).__name__}")
        return _compare_tensors(path, a, b)
    if type(a) is not type(b):
        return Difference(path, f"{type(a).__name__} vs {type(b).__name__}")
    if isinstance(a, float):
        same = struct.pack("<d", a) == struct.pack("<d", b)
    else:
        try:
            same = bool(a == b)
        except Exception as exc:  # an output type without a usable ==
            return Difference(path, f"cannot compare {type(a).__name__}: {exc!r}")
    return None if same else Difference(path, f"{a!r} vs {b!r}")


def _compare_tensors(path: str, a: torch.Tensor, b: torch.Tensor) -> Difference | None:
    if a.dtype != b.dtype:
        return Difference(path, f"dtype {a.dtype} vs {b.dtype}")
    if a.shape != b.shape:
        return Difference(path, f"shape {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.device != b.device:
        return Difference(path, f"device {a.device} vs {b.device}")
    # Complex values are compared as (real, imaginary) pairs, each part counting once.
    ra, rb = _real_view(a.detach()), _real_view(b.detach())
    ia, ib = _as_int(ra), _as_int(rb)
    if torch.equal(ia, ib):
        return None
    differ = ia != ib
    count = int(differ.sum())
    # Only the differing elements are widened, so a report costs memory in proportion to
    # the mismatch, not to the tensor.
    gap = (ra[differ].to(torch.float64) - rb[differ].to(torch.float64)).abs()
    gap = gap[~gap.isnan()]
    max_abs = float(gap.max()) if gap.numel() else math.nan
    return Difference(path, "bits differ", count, ra.numel(), max_abs)


def _real_view(t: torch.Tensor) -> torch.Tensor:
    # Lazy conjugate / negative views hold their values only as a flag: materialise them.
    t = t.resolve_conj().resolve_neg()
    return torch.view_as_real(t) if t.is_complex() else t


def _as_int(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        return t.view(_INT_OF_SIZE[t.element_size()])
    return t


def summarize(differences: list[Difference]) -> str:
    """One line for a log: the first few differences."""
    text = "; ".join(str(d) for d in differences[:3])
    return text + (f"; … {len(differences) - 3} more" if len(differences) > 3 else "")




def holds_tensor(value: Any) -> bool:
    """Whether ``value`` is a tensor or a tuple / list / dict holding one (at any depth)."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(holds_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(holds_tensor(v) for v in value.values())
    return False


def clone_tree(value: Any) -> Any:
    """A copy of ``value`` whose tensors are detached clones (containers rebuilt, named
    tuples kept as their type, other leaves shared)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return [clone_tree(v) for v in value]
    if isinstance(value, tuple):
        items = [clone_tree(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, dict):
        return {k: clone_tree(v) for k, v in value.items()}
    return value


def capturing() -> bool:
    """True inside torch.compile tracing or CUDA-graph capture, where side runs, host
    syncs and collectives must not happen."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
