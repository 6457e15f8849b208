"""Triton kernels for the tap's fingerprints, with the same hash as the torch reference.

The hash of words ``x_j`` is ``sum_j x_j * w_j mod 2**64`` with ``w_j = (j + 1) * G | 1``
(:func:`enginetap.tap.record.fingerprint.word_weights`). The torch path materialises the int64
words and the weights (three passes over eight bytes per word); the kernel computes the
weights from the index in registers and reads each word once, which is what lets a
whole-tensor fingerprint run near the device's read bandwidth.

- :func:`hash_rows_kernel`: every row of a ``[rows, width]`` buffer at once, one launch
  (the step's staged checkpoint rows, see :class:`~enginetap.tap.record.fingerprint.StepStaging`);
- :func:`fingerprint_tensor`: one hash of a whole tensor's bytes in two launches (per-chunk
  partial sums with global word positions, then their sum): state and KV continuity;
- :func:`hash_table_rows`: chosen rows of many tensors read in place through a table of
  base pointers, in one launch (the deferred checkpoints of a step, see
  :mod:`enginetap.tap.record.deferred`); a row may be pieces of several strided runs (a
  KV cache column: every head's key, then every head's value).

Both need Triton and a device it runs on (CUDA; on a CPU, Triton's interpreter, which the
tests use through ``TRITON_INTERPRET=1``). :func:`available` says whether they apply to a
tensor; callers fall back to torch otherwise.
"""

from __future__ import annotations

import os

import torch

__all__ = ["available", "fingerprint_tensor", "hash_rows_kernel", "hash_table_rows"]

GOLDEN_SIGNED = 0x9E3779B97F4A7C15 - (1 << 64)
"""The weight multiplier of :func:`~enginetap.tap.record.fingerprint.word_weights` as an int64."""

CHUNK_WORDS = 1 << 16
"""Words per program of the whole-tensor fingerprint (its partial sums: one per chunk)."""

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build may come without Triton
    triton = None  # type: ignore[assignment]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def available(tensor: torch.Tensor) -> bool:
    """Whether the kernels run on ``tensor``'s device here."""
    if triton is None:
        return False
    return tensor.is_cuda or (_INTERPRET and tensor.device.type == "cpu")


if triton is not None:

    @triton.jit
    def _hash_words(src, out, n_words, golden, ROW_WORDS: tl.constexpr, GLOBAL: tl.constexpr,
                    BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = row * ROW_WORDS
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        for start in range(0, ROW_WORDS, BLOCK):
            offs = start + tl.arange(0, BLOCK).to(tl.int64)
            mask = (offs < ROW_WORDS) & (base + offs < n_words)
            x = tl.load(src + base + offs, mask=mask, other=0).to(tl.int64)
            j = offs + base if GLOBAL else offs
            acc += x * (((j + 1) * golden) | 1)
        tl.store(out + row, tl.sum(acc, axis=0))

    @triton.jit
    def _hash_piece(src, width, segments, segment_stride, offset, max_words, golden,
                    BLOCK: tl.constexpr):
        # The ``segments * width`` words of one piece of a row (``segments`` runs of
        # ``width`` words, ``segment_stride`` words apart from ``src``), weighted as words
        # ``offset``, ``offset + 1``... of the row; their weighted sum.
        total = width * segments
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        if segments == 1:
            for start in range(0, max_words, BLOCK):  # a kernel argument, not a loaded value
                j = start + tl.arange(0, BLOCK).to(tl.int64)
                x = tl.load(src + j, mask=j < total, other=0).to(tl.int64)
                acc += x * (((offset + j + 1) * golden) | 1)
        else:
            runs = width.to(tl.int32)
            for start in range(0, max_words, BLOCK):
                j = start + tl.arange(0, BLOCK)
                run = j // runs
                at = run.to(tl.int64) * segment_stride + (j - run * runs).to(tl.int64)
                x = tl.load(src + at, mask=j < total, other=0).to(tl.int64)
                acc += x * (((offset + j.to(tl.int64) + 1) * golden) | 1)
        return tl.sum(acc, axis=0)

    @triton.jit
    def _hash_table(table, index, out, n_rows, max_words, golden, BLOCK: tl.constexpr):
        # table: [6, n] int64 = base address, row stride, segment width, segment count,
        # segment stride (all in 32-bit words but the address), second piece's address
        # (0: none; the same layout, its words after the first's in the row)
        c = tl.program_id(0).to(tl.int64)
        r = tl.program_id(1).to(tl.int64)
        n = tl.num_programs(0).to(tl.int64)
        base = tl.load(table + c).to(tl.pointer_type(tl.int32))
        stride = tl.load(table + n + c)
        width = tl.load(table + 2 * n + c)
        segments = tl.load(table + 3 * n + c)
        segment_stride = tl.load(table + 4 * n + c)
        second = tl.load(table + 5 * n + c)
        row = tl.load(index + r) * stride
        found = _hash_piece(base + row, width, segments, segment_stride, 0, max_words,
                            golden, BLOCK)
        if second != 0:
            found += _hash_piece(second.to(tl.pointer_type(tl.int32)) + row, width, segments,
                                 segment_stride, width * segments, max_words, golden, BLOCK)
        tl.store(out + c * n_rows + r, found)


def _words(flat: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as 32-bit words where their count allows, else bytes
    (the word size :func:`~enginetap.tap.record.fingerprint.hash_rows` uses)."""
    if flat.shape[-1] * flat.element_size() % 4 == 0:
        return flat.view(torch.int32)
    return flat.view(torch.uint8)


def hash_rows_kernel(rows: torch.Tensor) -> torch.Tensor:
    """``[..., width]`` rows (contiguous, any dtype) hashed per row: ``[...]`` int64, equal
    to :func:`~enginetap.tap.record.fingerprint.hash_rows` of each row; one launch."""
    words = _words(rows)
    lead = words.shape[:-1]
    flat = words.reshape(-1, words.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.int64, device=rows.device)
    if flat.shape[0]:
        width = flat.shape[1]
        block = min(1024, max(16, triton.next_power_of_2(width)))
        _hash_words[(flat.shape[0],)](flat, out, flat.numel(), GOLDEN_SIGNED, ROW_WORDS=width,
                                      GLOBAL=False, BLOCK=block, num_warps=4)
    return out.view(lead)


def fingerprint_tensor(tensor: torch.Tensor) -> int:
    """One order-sensitive hash of all of ``tensor``'s bytes (as stored, row-major): equal
    to ``hash_rows`` of the tensor flattened to one row. Two launches and one transfer."""
    flat = tensor.contiguous().reshape(1, -1)
    words = _words(flat.view(torch.uint8)).reshape(-1) if flat.numel() else flat.reshape(-1)
    if words.numel() == 0:
        return 0
    chunks = triton.cdiv(words.numel(), CHUNK_WORDS)
    partial = torch.empty(chunks, dtype=torch.int64, device=tensor.device)
    _hash_words[(chunks,)](words, partial, words.numel(), GOLDEN_SIGNED,
                           ROW_WORDS=CHUNK_WORDS, GLOBAL=True, BLOCK=2048, num_warps=8)
    return int(partial.sum().item())


def hash_table_rows(table: torch.Tensor, index: torch.Tensor, max_words: int) -> torch.Tensor:
    """Rows ``index`` of every tensor listed in ``table`` hashed in place: ``[n, rows]``
    int64, row ``r`` of entry ``c`` equal to :func:`~enginetap.tap.record.fingerprint.hash_rows`
    of the entry's row ``index[r]`` as one row of words. ``table`` is ``[6, n]`` int64 on
    the device, per entry: the base address (4-byte aligned), the row stride, the segment
    width, the segment count and the segment stride (in 32-bit words), and a second
    piece's base address (0: none). Row ``i`` of an entry is its ``segments`` runs of
    ``width`` words (``segment stride`` apart) from ``base + i * row stride``, then, where
    it has a second piece, the same runs from ``second + i * row stride``: an ordinary
    tensor's row is one segment, a KV cache column's row every head's key then every
    head's value (the hash is linear in the words' positions, so each piece is summed with
    its words' offset in the row, in place). ``max_words`` bounds each piece's words (it
    picks the block size and the loop's bound). One launch; no atomics (each program
    sums its row's pieces in order)."""
    n, rows = table.shape[1], index.numel()
    out = torch.empty((n, rows), dtype=torch.int64, device=index.device)
    if n and rows:
        block = min(1024, max(16, triton.next_power_of_2(max(1, max_words))))
        _hash_table[(n, rows)](table, index, out, rows, max(1, max_words), GOLDEN_SIGNED,
                               BLOCK=block, num_warps=4)
    return out
