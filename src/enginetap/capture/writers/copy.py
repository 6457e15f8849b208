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

from enginetap.capture.writers.pinned import ALIGN, PinnedRing, Region, ring_for

__all__ = ["STATS", "CopyStats", "HostCopies", "host_copy"]


@dataclass
class CopyStats:
    tensors: int = 0
    bytes: int = 0
    ring_misses: int = 0
    """Workloads whose copies found no room in the ring (copied to fresh host memory, or
    for a writer process sent through its pipe): the writer fell a ring behind."""


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
    """Host copies of one workload's tensors, with the event that says they landed and,
    on a GPU, the pinned ring region they sit in (released once written)."""

    values: dict[str, Any]
    event: Any = None
    nbytes: int = 0
    region: Region | None = None
    broken: bool = False
    """The device reported an error instead of the copies' completion."""

    @classmethod
    def of(cls, values: dict[str, Any], ring_bytes: int = 0,
           shared: PinnedRing | None = None) -> HostCopies:
        """Copy ``values``' tensors out; CUDA tensors go into one region of the process's
        pinned ring of ``ring_bytes`` when it has room (else fresh pinned memory). With
        ``shared`` (the ring a writer process maps) every tensor goes into one region of
        it, CPU tensors too, when it has room."""
        return cls.of_groups([values], ring_bytes, shared)[0]

    @classmethod
    def of_groups(cls, groups: list[dict[str, Any]], ring_bytes: int = 0,
                  shared: PinnedRing | None = None) -> list[HostCopies]:
        """:meth:`of` for several groups of one workload (inputs, outputs, checks) at once:
        one ring region and one event for all of them (the region is held by the first
        group's copies, so the workload gives it back once, with them)."""
        device = next((v.device for values in groups for v in values.values()
                       if isinstance(v, torch.Tensor) and v.is_cuda), None)
        if shared is not None:
            region = shared.reserve(sum(_aligned(v) for values in groups
                                        for v in values.values() if isinstance(v, torch.Tensor)))
        else:
            region = _reserve(groups, device, ring_bytes) if device is not None else None
        if region is None and (shared is not None or device is not None):
            STATS.ring_misses += 1
        made, offset = [], 0
        for values in groups:
            copied, nbytes = {}, 0
            for name, value in values.items():
                if isinstance(value, torch.Tensor):
                    if region is not None and (value.is_cuda or shared is not None):
                        value, offset = _into(region, offset, value)
                    else:
                        value = host_copy(value)
                    nbytes += value.numel() * value.element_size()
                copied[name] = value
            made.append(cls(copied, nbytes=nbytes))
        if device is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            for copies in made:
                copies.event = event
        made[0].region = region
        return made

    def landed(self) -> bool:
        """Whether the copies are done (never waits: a CUDA event query). A device error
        counts as done: :meth:`wait` then raises it where the writer handles errors."""
        try:
            return self.event is None or bool(self.event.query())
        except RuntimeError:
            self.broken = True
            return True

    def wait(self) -> dict[str, Any]:
        if self.event is not None:
            self.event.synchronize()
        return self.values

    def release(self) -> None:
        """Give the ring region back (after the copies were written or dropped)."""
        if self.region is not None:
            self.region.release()
            self.region = None


def _aligned(tensor: torch.Tensor) -> int:
    return -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN


def _reserve(groups: list[dict[str, Any]], device: torch.device,
             ring_bytes: int) -> Region | None:
    ring = ring_for(device, ring_bytes)
    if ring is None:
        return None
    return ring.reserve(sum(_aligned(v) for values in groups for v in values.values()
                            if isinstance(v, torch.Tensor) and v.is_cuda))


def _into(region: Region, offset: int, value: torch.Tensor) -> tuple[torch.Tensor, int]:
    STATS.tensors += 1
    STATS.bytes += value.numel() * value.element_size()
    target = region.take(offset, value.shape, value.dtype)
    target.copy_(value.detach() if value.requires_grad else value, non_blocking=value.is_cuda)
    return target, offset + _aligned(value)
