"""Copying a selected call's tensors out of the engine: the one place capture copies.

On a GPU a tensor goes to pinned host memory with a non-blocking copy, and an event
recorded after the copies lets the writer thread wait for them without stalling the
engine; on a CPU it is a contiguous clone (the engine reuses its buffers). Every copy is
counted (:data:`STATS`), so a test can show that unselected steps copy nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["STATS", "CopyStats", "HostCopies", "host_copy"]


@dataclass
class CopyStats:
    tensors: int = 0
    bytes: int = 0


STATS = CopyStats()


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of ``tensor`` that the engine can no longer change (see module doc)."""
    STATS.tensors += 1
    STATS.bytes += tensor.numel() * tensor.element_size()
    source = tensor.detach()
    if source.device.type == "cpu":
        return source.contiguous().clone() if source.is_contiguous() else source.contiguous()
    target = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
    target.copy_(source, non_blocking=True)
    return target


@dataclass
class HostCopies:
    """Host copies of one workload's tensors, with the event that says they landed."""

    values: dict[str, Any]
    event: Any = None
    nbytes: int = 0

    @classmethod
    def of(cls, values: dict[str, Any]) -> HostCopies:
        copied, nbytes, device = {}, 0, None
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                device = device or (value.device if value.device.type == "cuda" else None)
                value = host_copy(value)
                nbytes += value.numel() * value.element_size()
            copied[name] = value
        event = None
        if device is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        return cls(copied, event, nbytes)

    def wait(self) -> dict[str, Any]:
        if self.event is not None:
            self.event.synchronize()
        return self.values
