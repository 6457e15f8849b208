"""Row fingerprints: an order-sensitive hash of the bytes of tapped rows, on their device.

Per checkpoint the tapped rows' bytes are gathered into one per-step staging buffer on the
tensor's device (one gather, no host sync); at step end every staged row is hashed at
once (a handful of kernels whatever the number of checkpoints) and the hashes cross to
the host in one transfer. Cost per checkpoint is one launch plus microseconds of host
work; per-checkpoint launches, not bytes, are what tapping costs (see ENGINES.md).

The hash of a row of 32-bit words ``x_j`` is ``sum_j x_j * w_j mod 2**64`` with odd
weights ``w_j`` that depend on ``j``: a flipped bit or two swapped words change it. It is
computed on the bytes, so ``-0.0`` and ``0.0`` or two NaN payloads differ, as they should
for a bitwise tap. Rows whose byte length is not a multiple of 4 are zero-padded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["StepStaging", "hash_rows", "row_bytes", "word_weights"]

_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def word_weights(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The ``n`` odd int64 weights of word positions ``0..n-1`` (two's complement)."""
    values = [(((j + 1) * _GOLDEN) & _MASK) | 1 for j in range(n)]
    signed = [v - (1 << 64) if v >= 1 << 63 else v for v in values]
    return torch.tensor(signed, dtype=torch.int64, device=device)


def row_bytes(tensor: torch.Tensor, rows: int) -> torch.Tensor | None:
    """``tensor`` as ``[rows, nbytes]`` uint8 (a view where possible), or None when its
    leading dims do not flatten to ``rows`` token rows."""
    if tensor.dim() == 0 or tensor.numel() == 0:
        return None
    if tensor.shape[0] == rows:
        flat = tensor.reshape(rows, -1)
    elif tensor.dim() >= 2 and tensor.shape[0] * tensor.shape[1] == rows:
        flat = tensor.reshape(rows, -1)
    else:
        return None
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.uint8)


def hash_rows(rows: torch.Tensor) -> torch.Tensor:
    """Hashes of ``[k, nbytes]`` uint8 rows as ``[k]`` int64 (the reference the staged
    path must equal; used by tests and the benchmark)."""
    k, nbytes = rows.shape
    pad = (-nbytes) % 4
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    words = rows.contiguous().view(torch.int32).to(torch.int64)
    return (words * word_weights(words.shape[1], rows.device)).sum(dim=1)


@dataclass
class _Layout:
    row_of_word: torch.Tensor
    weight_of_word: torch.Tensor


@dataclass
class StepStaging:
    """One step's staged rows on one device; reused step after step."""

    rows: int
    device: torch.device
    buffer: torch.Tensor | None = None
    widths: list[int] = field(default_factory=list)
    used: int = 0
    _layouts: dict[tuple[int, tuple[int, ...]], _Layout] = field(default_factory=dict)

    def reset(self, rows: int) -> None:
        self.rows, self.widths, self.used = rows, [], 0

    def segment(self, nbytes: int) -> torch.Tensor:
        """A ``[rows, width]`` uint8 slot (``width`` = ``nbytes`` rounded up to 4)."""
        width = nbytes + (-nbytes) % 4
        need = self.used + self.rows * width
        if self.buffer is None or self.buffer.numel() < need:
            grown = torch.zeros(max(need, 2 * (self.buffer.numel() if self.buffer is not None
                                               else 0), 1 << 16),
                                dtype=torch.uint8, device=self.device)
            if self.buffer is not None and self.used:
                grown[:self.used].copy_(self.buffer[:self.used])
            self.buffer = grown
        slot = self.buffer[self.used:need].view(self.rows, width)
        self.used = need
        self.widths.append(width)
        return slot

    def stage(self, source: torch.Tensor, index: torch.Tensor) -> None:
        """Gather rows ``index`` of ``[n, nbytes]`` uint8 ``source`` into a new slot."""
        nbytes = source.shape[1]
        slot = self.segment(nbytes)
        if slot.shape[1] == nbytes:
            torch.index_select(source, 0, index, out=slot)
        else:
            slot[:, :nbytes].copy_(source.index_select(0, index))
            slot[:, nbytes:].zero_()

    def hashes(self) -> torch.Tensor:
        """``[slots, rows]`` int64 hashes of everything staged this step (on device)."""
        if not self.widths:
            return torch.zeros((0, self.rows), dtype=torch.int64, device=self.device)
        layout = self._layout()
        assert self.buffer is not None
        words = self.buffer[:self.used].view(torch.int32).to(torch.int64)
        out = torch.zeros(len(self.widths) * self.rows, dtype=torch.int64, device=self.device)
        out.index_add_(0, layout.row_of_word, words * layout.weight_of_word)
        return out.view(len(self.widths), self.rows)

    def _layout(self) -> _Layout:
        key = (self.rows, tuple(self.widths))
        found = self._layouts.get(key)
        if found is None:
            if len(self._layouts) > 64:  # layouts change with batch shape; keep a few
                self._layouts.clear()
            found = self._layouts[key] = self._build_layout()
        return found

    def _build_layout(self) -> _Layout:
        rows, weights = [], []
        longest = max(self.widths) // 4
        w = word_weights(longest, self.device)
        for slot, width in enumerate(self.widths):
            n = width // 4
            base = torch.arange(self.rows, device=self.device) + slot * self.rows
            rows.append(base.repeat_interleave(n))
            weights.append(w[:n].repeat(self.rows))
        return _Layout(torch.cat(rows), torch.cat(weights))
