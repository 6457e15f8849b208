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
class _Width:
    """Staged rows of one byte width: ``[slots, rows, width]`` in one growing buffer."""

    width: int
    buffer: torch.Tensor
    slots: int = 0


@dataclass
class StepStaging:
    """One step's staged rows on one device; buffers are kept and reused step after step.

    Rows are grouped by byte width (hidden size, expert count, KV row...), so that the
    hash at step end is a few uniform kernels per width, whatever the checkpoint count.
    """

    rows: int
    device: torch.device
    order: list[tuple[int, int]] = field(default_factory=list)
    """(width, slot) of every staged checkpoint, in staging order."""
    _widths: dict[int, _Width] = field(default_factory=dict)
    _weights: torch.Tensor | None = None

    def reset(self, rows: int) -> None:
        self.rows, self.order = rows, []
        for group in self._widths.values():
            group.slots = 0

    @property
    def used(self) -> int:
        """Bytes staged this step."""
        return sum(g.slots * self.rows * g.width for g in self._widths.values())

    def segment(self, nbytes: int) -> torch.Tensor:
        """A ``[rows, width]`` uint8 slot (``width`` = ``nbytes`` rounded up to 4)."""
        width = nbytes + (-nbytes) % 4
        group = self._widths.get(width)
        need = (group.slots + 1 if group else 1) * self.rows * width
        if group is None or group.buffer.numel() < need:
            grown = torch.zeros(max(need, 2 * (group.buffer.numel() if group else 0),
                                    16 * self.rows * width), dtype=torch.uint8, device=self.device)
            if group is not None:
                grown[:group.buffer.numel()].copy_(group.buffer)
                group.buffer = grown
            else:
                group = self._widths[width] = _Width(width, grown)
        start = group.slots * self.rows * width
        self.order.append((width, group.slots))
        group.slots += 1
        return group.buffer[start:start + self.rows * width].view(self.rows, width)

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
        """``[slots, rows]`` int64 hashes of everything staged this step (on device), in
        staging order; a few kernels per distinct width."""
        if not self.order:
            return torch.zeros((0, self.rows), dtype=torch.int64, device=self.device)
        parts, base = [], {}
        for width, group in self._widths.items():
            if group.slots:
                base[width] = sum(p.shape[0] for p in parts)
                parts.append(self._hash_width(group))
        stacked = torch.cat(parts) if len(parts) > 1 else parts[0]
        if len(parts) == 1:
            return stacked
        order = torch.tensor([base[w] + slot for w, slot in self.order], device=self.device)
        return stacked.index_select(0, order)

    def _hash_width(self, group: _Width) -> torch.Tensor:
        words = group.width // 4
        n = group.slots * self.rows
        view = group.buffer[:n * group.width].view(torch.int32).view(n, words)
        return (view.to(torch.int64) * self._weights_for(words)).sum(dim=1).view(
            group.slots, self.rows)

    def _weights_for(self, words: int) -> torch.Tensor:
        if self._weights is None or self._weights.numel() < words:
            self._weights = word_weights(max(words, 1024), self.device)
        return self._weights[:words]
