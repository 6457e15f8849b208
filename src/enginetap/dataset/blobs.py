"""Tensor blobs: safetensors files written without extra copies and read only when regular.

Writing: :func:`host_tensors` gives each tensor as safetensors can write it (dense,
contiguous, on the CPU, no two sharing memory) and copies only the tensors that are not
already so: a contiguous CPU tensor is written straight from its own memory. A device
tensor is copied to the host once, which cannot be avoided. :func:`blob_chunks` lays such
tensors out as the safetensors file itself (the header, then each tensor's own memory),
byte for byte what ``safetensors.torch.save`` writes, for a writer to hand to the kernel
in one ``writev``: the capture writer runs beside the engine's thread, and this is a few
Python operations per tensor where safetensors' own Python takes tens, each holding the
interpreter the engine waits for. A dtype outside its table gives None (write it with
:func:`save_blob`).

Reading: blobs are opened through :func:`enginetap.core.files.open_regular`, so a FIFO
or device in place of a blob is reported, never waited on.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from enginetap.dataset.dtypes import from_header
from enginetap.core.files import NotRegular, open_regular, path_of_fd

if TYPE_CHECKING:
    import torch

__all__ = ["Header", "blob_chunks", "byte_view", "host_tensors", "load_tensors", "read_header",
           "save_blob"]

Header = dict[str, tuple[str, tuple[int, ...]]]
"""Tensor key -> (schema dtype name, shape), as a blob's header records them."""


def host_tensors(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``named`` as safetensors can write them, copying only where it must.

    A tensor is copied when it is on another device, not contiguous, or shares memory
    with a tensor earlier in ``named`` (safetensors refuses shared memory); otherwise the
    caller's tensor itself is returned (detached), so it must not change until written.
    """
    import torch

    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, tensor in named.items():
        t = tensor.detach()
        if t.device.type != "cpu" or not t.is_contiguous() or _storage(t) in seen:
            t = t.to("cpu", memory_format=torch.contiguous_format, copy=True)
        if t.untyped_storage().nbytes():
            seen.add(_storage(t))
        out[name] = t
    return out


def _storage(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def save_blob(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write ``tensors`` (as :func:`host_tensors` returns them) to the safetensors file ``path``."""
    import safetensors.torch

    safetensors.torch.save_file(dict(tensors), str(path))


# torch dtype -> (safetensors' name, its rank in safetensors' layout: data is written by
# descending rank, then by name; measured against safetensors 0.8's own files).
_LAYOUT = {
    "int64": ("I64", 15), "float64": ("F64", 14), "float32": ("F32", 12),
    "int32": ("I32", 10), "bfloat16": ("BF16", 9), "float16": ("F16", 8),
    "int16": ("I16", 6), "float8_e4m3fn": ("F8_E4M3", 5), "float8_e5m2": ("F8_E5M2", 4),
    "int8": ("I8", 3), "uint8": ("U8", 2), "float4_e2m1fn_x2": ("F4", 1), "bool": ("BOOL", 0),
}


def blob_chunks(tensors: Mapping[str, torch.Tensor]) -> list[bytes | memoryview] | None:
    """The safetensors file of ``tensors`` (as :func:`host_tensors` returns them) as
    buffers to write in order: the header, then each tensor's bytes, viewed, not copied.
    None when a tensor's dtype is not in this writer's table (or is a 0-d packed fp4)."""
    order = []
    for name, tensor in tensors.items():
        layout = _LAYOUT.get(str(tensor.dtype)[6:])
        if layout is None or (layout[0] == "F4" and not tensor.dim()):
            return None  # a packed fp4 scalar: safetensors' own rules apply
        order.append((-layout[1], name, layout[0], tensor))
    order.sort(key=lambda entry: entry[:2])
    header: dict[str, dict[str, object]] = {}
    chunks: list[bytes | memoryview] = [b""]
    offset = 0
    for _, name, dtype, tensor in order:
        shape = list(tensor.shape)
        if dtype == "F4" and shape:
            shape[-1] *= 2  # safetensors counts fp4 values, torch packed pairs
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        if size:
            chunks.append(byte_view(tensor))
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    chunks[0] = struct.pack("<Q", len(text)) + text
    return chunks


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU ``tensor`` (not empty), viewed in place."""
    import torch

    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def read_header(path: Path) -> Header | str:
    """Every tensor's dtype and shape from the blob's header, or why it cannot be read.

    safetensors checks the header against the file size; tensor data is not read.
    """
    from safetensors import SafetensorError, safe_open

    try:
        with open_regular(path) as fd, safe_open(path_of_fd(fd, path), framework="pt") as f:
            return {k: from_header(f.get_slice(k).get_dtype(), f.get_slice(k).get_shape())
                    for k in f.keys()}
    except NotRegular as exc:
        return str(exc)
    except (OSError, SafetensorError) as exc:
        return f"cannot be read ({exc})"


def load_tensors(path: Path, keys: Iterable[str]) -> dict[str, torch.Tensor]:
    """The tensors stored under ``keys`` in the blob ``path``, on the CPU.

    Raises:
        OSError: the blob is not a regular file (:class:`NotRegular`) or cannot be read.
        SafetensorError: it is not a valid safetensors file, or lacks a key.
    """
    from safetensors import safe_open

    with open_regular(path) as fd, safe_open(path_of_fd(fd, path), framework="pt",
                                             device="cpu") as f:
        return {key: f.get_tensor(key) for key in keys}
