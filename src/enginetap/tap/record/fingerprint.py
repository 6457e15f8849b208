"""Row fingerprints: an order-sensitive hash of the bytes of tapped rows, on their device.

The recorder hashes staged rows (:mod:`enginetap.tap.record.staging`) and tensors kept
until step end (:mod:`enginetap.tap.record.deferred`) with this function; the compiled
tap (:mod:`enginetap.tap.record.compiled`) inside the graph. Here: the reference, the weights and
the whole-tensor hash.

The hash of a row of 32-bit words ``x_j`` is ``sum_j x_j * w_j mod 2**64`` with odd
weights ``w_j`` that depend on ``j``: a flipped bit or two swapped words change it. It is
computed on the bytes, so ``-0.0`` and ``0.0`` or two NaN payloads differ, as they should
for a bitwise tap. Rows whose byte length is not a multiple of 4 are hashed byte by byte.
"""

from __future__ import annotations

import torch

__all__ = ["fingerprint", "hash_rows", "row_bytes", "token_rows", "word_weights"]

_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def word_weights(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The ``n`` odd int64 weights of word positions ``0..n-1`` (two's complement)."""
    values = [(((j + 1) * _GOLDEN) & _MASK) | 1 for j in range(n)]
    signed = [v - (1 << 64) if v >= 1 << 63 else v for v in values]
    return torch.tensor(signed, dtype=torch.int64, device=device)


def token_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor | None:
    """``tensor`` as ``[rows, width]`` in its own dtype (a view where it is contiguous),
    or None when its leading dims do not flatten to ``rows`` token rows."""
    if tensor.dim() == 0 or tensor.numel() == 0:
        return None
    if tensor.shape[0] != rows and not (tensor.dim() >= 2
                                        and tensor.shape[0] * tensor.shape[1] == rows):
        return None
    flat = tensor.view(rows, -1) if tensor.is_contiguous() else tensor.reshape(rows, -1)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    return flat.view(torch.uint8) if flat.dtype == torch.bool else flat


def row_bytes(tensor: torch.Tensor, rows: int) -> torch.Tensor | None:
    """:func:`token_rows` as ``[rows, nbytes]`` uint8."""
    flat = token_rows(tensor, rows)
    return None if flat is None else flat.view(torch.uint8)


def _words(rows: torch.Tensor) -> torch.Tensor:
    """``[..., width]`` rows as int64 words: 32-bit words where a row's bytes are a multiple
    of 4 long, single bytes otherwise."""
    if rows.shape[-1] * rows.element_size() % 4 == 0:
        return rows.view(torch.int32).to(torch.int64)
    return rows.view(torch.uint8).to(torch.int64)


def hash_rows(rows: torch.Tensor) -> torch.Tensor:
    """Hashes of ``[k, width]`` rows (any dtype) as ``[k]`` int64: the reference the staged
    path equals (tests, the benchmark)."""
    words = _words(rows.contiguous())
    return (words * word_weights(words.shape[1], rows.device)).sum(dim=1)


def fingerprint(tensor: torch.Tensor, chunk: int = 1 << 22) -> int:
    """One hash of all of ``tensor``'s bytes (``hash_rows`` of it as one row): a whole
    recurrent state or KV cache, compared between steps. On CUDA one Triton kernel near
    read bandwidth (:mod:`enginetap.tap.record.kernels`); elsewhere torch, ``chunk`` words at a
    time."""
    from enginetap.tap.record import kernels

    if kernels.available(tensor):
        return kernels.fingerprint_tensor(tensor)
    words = _words(tensor.contiguous().reshape(1, -1))[0]
    total = torch.zeros((), dtype=torch.int64, device=tensor.device)
    for start in range(0, words.numel(), chunk):
        part = words[start:start + chunk]
        weights = _weights_from(start, part.numel(), tensor.device)
        total += (part * weights).sum()
    return int(total.item())


def _weights_from(start: int, n: int, device: torch.device) -> torch.Tensor:
    """``word_weights`` of positions ``start..start+n-1``, computed on ``device``."""
    j = torch.arange(start + 1, start + n + 1, dtype=torch.int64, device=device)
    golden = _GOLDEN - (1 << 64)
    return (j * golden) | 1
