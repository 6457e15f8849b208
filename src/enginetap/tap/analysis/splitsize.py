"""How large a pair's split is, read from the raw rows a run wrote (``options.tap.vectors``).

Hashes say *where* two same-prefix rows first differ; the rows themselves say by how much.
This reads the step's ``tap-vectors-rank<r>/step<N>.safetensors`` with NumPy alone (the
analysis side imports no torch): the file's JSON header, then only the culprit
checkpoint's bytes. bfloat16 is widened to float32 bit for bit.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["SplitSize", "split_size", "vectors_file"]

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class SplitSize:
    """Two rows of one checkpoint compared element by element."""

    checkpoint: str
    dtype: str
    width: int
    differing: int
    max_abs: float
    file: Path

    def describe(self) -> str:
        return (f"{self.differing} of {self.width} elements differ, max |a - b| "
                f"{self.max_abs:.4g} ({self.checkpoint}, {self.dtype.lower()}, "
                f"{self.file.parent.name}/{self.file.name})")


def vectors_file(root: Path, rank: int, step: int) -> Path:
    return root / f"tap-vectors-rank{rank}" / f"step{step}.safetensors"


def split_size(root: Path, rank: int, step: int, checkpoint: str, keys: tuple[str, str],
               position: int) -> SplitSize | None:
    """The size of the split of ``keys`` at ``position`` in ``checkpoint`` at ``step``;
    None when no vectors file holds both rows there (or it cannot be read)."""
    path = vectors_file(root, rank, step)
    try:
        header, start = _header(path)
        rows = json.loads(header["__metadata__"]["rows"])
        entry = header[checkpoint]
        i, j = (rows.index([key, position]) for key in keys)
        values = _tensor(path, start, entry)
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    a, b = values[i].astype(np.float64), values[j].astype(np.float64)
    diff = np.abs(a - b)
    differing = int(np.count_nonzero((a != b) & ~(np.isnan(a) & np.isnan(b))))
    return SplitSize(checkpoint, entry["dtype"], int(values.shape[1]), differing,
                     float(np.nanmax(diff)) if diff.size else 0.0, path)


def _header(path: Path) -> tuple[dict[str, Any], int]:
    with path.open("rb") as handle:
        (size,) = struct.unpack("<Q", handle.read(8))
        if size > _MAX_HEADER:
            raise ValueError(f"header of {size} bytes")
        return json.loads(handle.read(size)), 8 + size


def _tensor(path: Path, start: int, entry: dict[str, Any]) -> np.ndarray:
    kind = _DTYPES[entry["dtype"]]
    first, last = entry["data_offsets"]
    shape = [int(n) for n in entry["shape"]]
    with path.open("rb") as handle:
        handle.seek(start + first)
        raw = handle.read(last - first)
    values = np.frombuffer(raw, dtype=np.dtype(kind).newbyteorder("<")).reshape(shape)
    if entry["dtype"] == "BF16":
        values = (values.astype(np.uint32) << 16).view(np.float32)
    return values.reshape(shape[0], -1)
