"""One fused kernel per checkpoint on CUDA: gather the tapped rows and hash them.

The graph tap's op (:mod:`enginetap.tap.record.compiled`) otherwise costs a handful of small
kernels per checkpoint (gather, widen, weights, multiply, sum, store, flag); inside a
replayed CUDA graph their launches, not their bytes, are the tap's cost. This Triton
kernel does it in one launch: program ``(r, c)`` reads block ``c`` of row ``index[r]``
as 32-bit words and adds ``sum(word * weight(j))`` in int64 (wrapping, as the torch
reference does; integer addition in any order gives the same sum) into ``out[r]``
(atomically where a row has several blocks: the buffer is zeroed at step begin, see
:meth:`CompiledTap.begin`); program ``(0, 0)`` sets the slot's flag.
The weights are :func:`~enginetap.tap.record.fingerprint.word_weights`'s, so the hash equals
:func:`~enginetap.tap.record.fingerprint.hash_rows` bit for bit. Used where Triton imports and
a row is whole 32-bit words; None otherwise (the caller takes the torch path).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from enginetap.tap.record.fingerprint import _GOLDEN

__all__ = ["fused_hash"]

_BLOCK = 512


@functools.cache
def _kernel() -> Any:
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def hash_rows_kernel(src, row_stride, index, out, flag, words, golden,
                         BLOCK: tl.constexpr, SPLIT: tl.constexpr):
        r = tl.program_id(0)
        c = tl.program_id(1)
        row = tl.load(index + r)
        j = c * BLOCK + tl.arange(0, BLOCK)
        keep = j < words
        word = tl.load(src + row * row_stride + j, mask=keep, other=0).to(tl.int64)
        weight = ((j + 1).to(tl.int64) * golden) | 1
        part = tl.sum(word * weight, axis=0)
        if SPLIT:
            tl.atomic_add(out + r, part)  # the slot was zeroed at step begin
        else:
            tl.store(out + r, part)
        if r == 0 and c == 0:
            tl.store(flag, 1)

    return hash_rows_kernel


def fused_hash(buffer: torch.Tensor, rows: torch.Tensor, index: torch.Tensor,
               slot: int) -> bool:
    """Hash ``rows[index]`` (``[padded, width]``, CUDA) into ``buffer[slot]`` and flag
    it, in one launch; False (nothing done) where the kernel cannot take these rows."""
    kernel = _kernel()
    if kernel is None or not rows.is_cuda or rows.stride(-1) != 1:
        return False
    size = rows.element_size()
    if (rows.shape[1] * size) % 4 or (rows.stride(0) * size) % 4 or rows.data_ptr() % 4:
        return False
    words = rows.view(torch.uint8).view(torch.int32)  # [padded, width words], a view
    chunks = -(-words.shape[1] // _BLOCK)
    kernel[(index.numel(), chunks)](words, words.stride(0), index, buffer[slot],
                                    buffer[slot, -1:], words.shape[1], _GOLDEN - (1 << 64),
                                    BLOCK=_BLOCK, SPLIT=chunks > 1)
    return True
