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
- :func:`hash_table_rows`: chosen rows of many tensors, read in place through a table of
  base pointers, in one launch (the deferred checkpoints of a step, see
  :mod:`enginetap.tap.record.deferred`).

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
    def _hash_table(table, index, out, n_rows, max_width, golden, BLOCK: tl.constexpr):
        # table: [3, n] int64 = base address, row stride in words, row width in words
        c = tl.program_id(0).to(tl.int64)
        r = tl.program_id(1).to(tl.int64)
        n = tl.num_programs(0).to(tl.int64)
        base = tl.load(table + c).to(tl.pointer_type(tl.int32))
        stride = tl.load(table + n + c)
        width = tl.load(table + 2 * n + c)
        src = base + tl.load(index + r) * stride
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        for start in range(0, max_width, BLOCK):  # a kernel argument, not a loaded value
            offs = start + tl.arange(0, BLOCK).to(tl.int64)
            x = tl.load(src + offs, mask=offs < width, other=0).to(tl.int64)
            acc += x * (((offs + 1) * golden) | 1)
        tl.store(out + c * n_rows + r, tl.sum(acc, axis=0))


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
    int64, row ``r`` of tensor ``c`` equal to :func:`~enginetap.tap.record.fingerprint.hash_rows`
    of ``tensor_c[index[r]]``. ``table`` is ``[3, n]`` int64 on the device: each tensor's
    base address (4-byte aligned), row stride and row width, both in 32-bit words;
    ``max_words`` bounds the widths (it picks the block size). One launch."""
    n, rows = table.shape[1], index.numel()
    out = torch.empty((n, rows), dtype=torch.int64, device=index.device)
    if n and rows:
        block = min(1024, max(16, triton.next_power_of_2(max(1, max_words))))
        _hash_table[(n, rows)](table, index, out, rows, max(1, max_words), GOLDEN_SIGNED,
                               BLOCK=block, num_warps=4)
    return out
