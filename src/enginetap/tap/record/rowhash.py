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

:func:`hash_slots` does the same for several checkpoints in one launch (the graphs
mode's checkpoints of one decoder layer, see :meth:`CompiledTap.flush`), read through a
table of ``(address, row stride, words, slot)`` entries on the device.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from enginetap.tap.record.fingerprint import _GOLDEN

__all__ = ["ENTRY", "entry", "fusable", "fused_hash", "hash_slots"]

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

    @triton.jit
    def hash_slots_kernel(table, index, out, out_stride, golden, BLOCK: tl.constexpr):
        # table: [entries, 4] int64 = base address, row stride and row width in 32-bit
        # words, the buffer slot it hashes into
        e = tl.program_id(0).to(tl.int64)
        r = tl.program_id(1)
        c = tl.program_id(2)
        src = tl.load(table + 4 * e).to(tl.pointer_type(tl.int32))
        stride = tl.load(table + 4 * e + 1)
        words = tl.load(table + 4 * e + 2)
        slot = tl.load(table + 4 * e + 3)
        row = tl.load(index + r).to(tl.int64)
        j = (c * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        word = tl.load(src + row * stride + j, mask=j < words, other=0).to(tl.int64)
        part = tl.sum(word * (((j + 1) * golden) | 1), axis=0)
        if c * BLOCK < words:
            tl.atomic_add(out + slot * out_stride + r, part)  # slots zeroed at step begin
        if r == 0 and c == 0:
            tl.store(out + slot * out_stride + out_stride - 1, 1)

    return hash_rows_kernel, hash_slots_kernel


ENTRY = 4
"""int64 values per :func:`hash_slots` table entry."""


def fusable(rows: torch.Tensor) -> bool:
    """Whether the kernels here take ``rows`` (``[padded, width]``): on CUDA with Triton,
    its last dim contiguous, rows of whole 32-bit words at a 4-byte aligned address."""
    if _kernel() is None or not rows.is_cuda or rows.stride(-1) != 1:
        return False
    size = rows.element_size()
    return not ((rows.shape[1] * size) % 4 or (rows.stride(0) * size) % 4
                or rows.data_ptr() % 4)


def entry(rows: torch.Tensor, slot: int) -> list[int]:
    """The :func:`hash_slots` table entry of ``rows`` (:func:`fusable`) into ``slot``."""
    size = rows.element_size()
    return [rows.data_ptr(), rows.stride(0) * size // 4, rows.shape[1] * size // 4, slot]


def hash_slots(buffer: torch.Tensor, table: torch.Tensor, entries: int, index: torch.Tensor,
               widest: int) -> None:
    """Hash rows ``index`` of each of ``table``'s ``entries`` (``[entries, ENTRY]`` int64 on
    the device, see :func:`entry`) into its slot of ``buffer`` and flag it, in one launch;
    ``widest``: the most words in a row (the grid's blocks per row). Every slot must be
    zero before (the blocks of a row are added)."""
    kernel = _kernel()
    assert kernel is not None
    blocks = -(-widest // _BLOCK)
    kernel[1][(entries, index.numel(), blocks)](table, index, buffer, buffer.stride(0),
                                                _GOLDEN - (1 << 64), BLOCK=_BLOCK)


def fused_hash(buffer: torch.Tensor, rows: torch.Tensor, index: torch.Tensor,
               slot: int) -> bool:
    """Hash ``rows[index]`` (``[padded, width]``, CUDA) into ``buffer[slot]`` and flag
    it, in one launch; False (nothing done) where the kernel cannot take these rows."""
    if not fusable(rows):
        return False
    words = rows.view(torch.uint8).view(torch.int32)  # [padded, width words], a view
    chunks = -(-words.shape[1] // _BLOCK)
    _kernel()[0][(index.numel(), chunks)](words, words.stride(0), index, buffer[slot],
                                          buffer[slot, -1:], words.shape[1],
                                          _GOLDEN - (1 << 64), BLOCK=_BLOCK, SPLIT=chunks > 1)
    return True
