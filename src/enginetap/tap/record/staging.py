"""A step's staging buffer: the tapped rows of gathered checkpoints, grouped by dtype and
width, hashed at step end by a few uniform kernels per group (:func:`hash_rows`' function
of the same bytes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from enginetap.tap.record.fingerprint import _words, word_weights

__all__ = ["StepStaging"]


@dataclass
class _Group:
    """Staged rows of one (dtype, width, rows): ``[capacity, rows, width]``, its slot views
    made once (a checkpoint then costs one gather and no other tensor call)."""

    buffer: torch.Tensor
    views: list[torch.Tensor]
    slots: int = 0

    @classmethod
    def new(cls, capacity: int, rows: int, width: int, dtype: torch.dtype,
            device: torch.device) -> _Group:
        buffer = torch.zeros((capacity, rows, width), dtype=dtype, device=device)
        return cls(buffer, list(buffer.unbind(0)))


@dataclass
class StepStaging:
    """One step's staged rows on one device; buffers are kept and reused step after step.

    Rows are grouped by dtype and width (hidden size, expert count, KV row...), so that
    the hash at step end is a few uniform kernels per group, whatever the checkpoint
    count, and a checkpoint is one gather into a ready slot.
    """

    rows: int
    device: torch.device
    order: list[tuple[tuple[Any, ...], int]] = field(default_factory=list)
    inverse: torch.Tensor | None = None
    """(group key, slot) of every staged checkpoint, in staging order."""
    _groups: dict[tuple[Any, ...], _Group] = field(default_factory=dict)
    _weights: torch.Tensor | None = None

    def reset(self, rows: int, inverse: torch.Tensor | None = None) -> None:
        """Start a step of ``rows`` tapped rows; ``inverse`` maps each row to its
        request's slot row in per-request slots (see :meth:`stage_per_request`)."""
        self.rows, self.order, self.inverse = rows, [], inverse
        for group in self._groups.values():
            group.slots = 0

    @property
    def used(self) -> int:
        """Bytes staged this step."""
        return sum(g.slots * g.buffer[0].numel() * g.buffer.element_size()
                   for g in self._groups.values())

    def slot(self, dtype: torch.dtype, width: int, rows: int | None = None) -> torch.Tensor:
        """The next free ``[rows, width]`` slot of ``dtype`` (``rows`` given: a
        per-request slot of that many requests)."""
        key = (dtype, width, self.rows if rows is None else rows, rows is not None)
        group = self._groups.get(key)
        if group is None or group.slots == len(group.views):
            grown = _Group.new(max(8, 2 * (len(group.views) if group else 0)), key[2],
                               width, dtype, self.device)
            if group is not None:
                grown.buffer[:group.slots].copy_(group.buffer[:group.slots])
                grown.slots = group.slots
            group = self._groups[key] = grown
        self.order.append((key, group.slots))
        group.slots += 1
        return group.views[group.slots - 1]

    def view_of(self, j: int) -> torch.Tensor:
        """The ``j``-th slot staged this step (``[rows, width]``, the staged bytes)."""
        key, slot = self.order[j]
        view = self._groups[key].views[slot]
        return view.index_select(0, self.inverse) if key[3] and self.inverse is not None \
            else view

    def stage(self, source: torch.Tensor, index: torch.Tensor | None) -> None:
        """Gather rows ``index`` of ``[n, width]`` ``source`` into a new slot (``index``
        None: ``source`` holds exactly the tapped rows)."""
        slot = self.slot(source.dtype, source.shape[1])
        if index is None:
            slot.copy_(source)
        else:
            torch.index_select(source, 0, index, out=slot)

    def stage_per_request(self, source: torch.Tensor) -> None:
        """Stage ``[requests, width]`` ``source``: one row per request of the tapped rows
        (state a request carries, hashed once however many of its rows are tapped)."""
        self.slot(source.dtype, source.shape[1], rows=source.shape[0]).copy_(source)

    def hashes(self) -> torch.Tensor:
        """``[slots, rows]`` int64 hashes of everything staged this step (on device), in
        staging order; a few kernels per group."""
        if not self.order:
            return torch.zeros((0, self.rows), dtype=torch.int64, device=self.device)
        parts, base, offset = [], {}, 0
        for key, group in self._groups.items():
            if group.slots:
                base[key], offset = offset, offset + group.slots
                hashed = self._hash_group(group)
                if key[3]:  # per request: each tapped row takes its request's hash
                    assert self.inverse is not None, "per-request slots need reset(inverse=)"
                    hashed = hashed.index_select(1, self.inverse)
                parts.append(hashed)
        if len(parts) == 1:
            return parts[0]
        order = torch.tensor([base[key] + slot for key, slot in self.order], device=self.device)
        return torch.cat(parts).index_select(0, order)

    def _hash_group(self, group: _Group) -> torch.Tensor:
        from enginetap.tap.record import kernels

        staged = group.buffer[:group.slots]
        if staged.is_cuda and kernels.available(staged):
            return kernels.hash_rows_kernel(staged)  # one launch, no int64 copies
        words = _words(staged)
        return (words * self._weights_for(words.shape[-1])).sum(dim=-1)

    def _weights_for(self, words: int) -> torch.Tensor:
        if self._weights is None or self._weights.numel() < words:
            self._weights = word_weights(max(words, 1024), self.device)
        return self._weights[:words]
