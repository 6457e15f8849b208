"""A ring of pinned host memory that selected calls copy into, reused workload after workload.

Pinning fresh host pages costs more than moving the bytes: on the H200 machine a selected
decode step copying 567 MB spent most of its time in new pinned allocations, at about
2.5 GB/s, against 55 GB/s for the copy into memory already pinned. The ring is pinned
once per device and process (on the first selected call) and handed out in order:
workloads are written in the order they were copied, so space comes back in the same
order. A workload released out of order (dropped, refused) is kept until everything
before it is released. When the ring has no room the caller falls back to a fresh pinned
allocation; nothing waits here.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache

import torch

__all__ = ["CONTROL_BYTES", "PinnedRing", "Region", "ring_for", "set_control", "shared_ring"]

logger = logging.getLogger("enginetap.capture")

ALIGN = 256

_WORD = struct.Struct("<q")
CONTROL_BYTES = ALIGN
"""A shared ring's memory past its capacity: control words the writer process sets
(see :mod:`enginetap.capture.writers.process`)."""


@dataclass(eq=False)
class Region:
    """One workload's bytes in the ring: ``[start, end)``."""

    ring: PinnedRing
    start: int
    end: int
    released: bool = False

    def take(self, offset: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` at ``offset`` bytes into the region."""
        return self.ring.view_at(self.start + offset, shape, dtype)

    def release(self) -> None:
        self.ring.release(self)


@dataclass
class PinnedRing:
    capacity: int
    pin: bool = True
    """False only to test the ring's bookkeeping on a machine without a GPU."""
    shared: bool = False
    """Host memory another process can map (``fd``, a memfd): the capture writer process
    reads workloads where the engine copied them. Pinned, where ``pin``, by registering
    it with CUDA. The memory holds :data:`CONTROL_BYTES` more, past ``capacity``: the
    control words (:meth:`control`)."""
    buffer: torch.Tensor = field(init=False)
    fd: int = -1
    _live: deque[Region] = field(default_factory=deque)
    _head: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _map: mmap.mmap | None = None
    _typed: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.shared:
            self.buffer = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=self.pin)
            return
        self.fd = os.memfd_create("enginetap-capture-ring", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.capacity + CONTROL_BYTES)
            self._map = mmap.mmap(self.fd, self.capacity + CONTROL_BYTES)
        except OSError:
            os.close(self.fd)
            raise
        self.buffer = torch.frombuffer(self._map, dtype=torch.uint8, count=self.capacity)
        if self.pin and not _register(self.buffer):
            self.pin = False

    def control(self, word: int = 0) -> int:
        """A shared ring's control word ``word`` (-1 until the writer process sets it): a
        read of shared memory, no system call."""
        if self._map is None:
            return -1
        return _WORD.unpack_from(self._map, self.capacity + word * _WORD.size)[0]

    def view_at(self, at: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of ``shape`` and ``dtype`` at byte ``at`` of the buffer (a
        multiple of the dtype's size). One strided view of the buffer seen as ``dtype``:
        slicing the bytes and viewing them twice cost five times as long, and a selected
        decode step takes some 120 of these."""
        typed = self._typed.get(dtype)
        if typed is None:
            whole = self.capacity // dtype.itemsize * dtype.itemsize
            typed = self._typed[dtype] = self.buffer[:whole].view(dtype)
        return typed.as_strided(shape, _strides(tuple(shape)), at // dtype.itemsize)

    @property
    def base(self) -> int:
        """The buffer's address (offsets of tensors in it are taken from here)."""
        return self.buffer.data_ptr()

    def unpin(self) -> None:
        """Unregister a shared ring's memory from CUDA (its owner is done with it; the
        mapping itself goes with the last tensor viewing it)."""
        if self.shared and self.pin:
            self.pin = False
            torch.cuda.cudart().cudaHostUnregister(self.base)

    def reserve(self, nbytes: int) -> Region | None:
        """``nbytes`` of the ring after everything still held, or None if they do not fit."""
        size = -(-nbytes // ALIGN) * ALIGN
        with self._lock:
            start = self._fit(size)
            if start is None:
                return None
            region = Region(self, start, start + size)
            self._live.append(region)
            self._head = start + size
            return region

    def _fit(self, size: int) -> int | None:
        if size > self.capacity:
            return None
        if not self._live:
            return 0
        tail = self._live[0].start
        if self._head > tail:  # held bytes are [tail, head): room after head, or from 0
            if self._head + size <= self.capacity:
                return self._head
            return 0 if size <= tail else None
        # wrapped: held bytes are [tail, capacity) and [0, head); room is [head, tail)
        return self._head if self._head + size <= tail else None

    def release(self, region: Region) -> None:
        with self._lock:
            region.released = True
            while self._live and self._live[0].released:
                self._live.popleft()
            if not self._live:
                self._head = 0

    @property
    def held(self) -> int:
        """Bytes between the oldest held region and the head (tests, logs)."""
        with self._lock:
            return sum(r.end - r.start for r in self._live)


@lru_cache(maxsize=1024)
def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of ``shape``, in elements."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _register(buffer: torch.Tensor) -> bool:
    """Pin ``buffer`` (host memory torch did not allocate) for asynchronous device copies;
    False (logged) where CUDA refuses or is absent: copies into it then wait."""
    if not torch.cuda.is_available():
        return False
    try:
        code = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0))
    except Exception as exc:  # noqa: BLE001 - a torch build without the binding, a CUDA error
        code = f"{type(exc).__name__}: {exc}"
    if code != 0:
        logger.warning("enginetap capture: cannot pin the shared capture ring (cudaHostRegister: "
                       "%s); device copies into it will wait for the device", code)
        return False
    return True


def shared_ring(capacity: int, pin: bool) -> PinnedRing:
    """A new ring in shared host memory (for the capture writer process), its control
    words at -1."""
    ring = PinnedRing(capacity, pin=pin, shared=True)
    for word in range(CONTROL_BYTES // _WORD.size):
        set_control(ring._map, capacity, -1, word)  # type: ignore[arg-type]
    return ring


def set_control(mapping: mmap.mmap, capacity: int, value: int, word: int = 0) -> None:
    """Set control word ``word`` of a shared ring of ``capacity`` bytes mapped at
    ``mapping`` (the writer process's side of :meth:`PinnedRing.control`)."""
    _WORD.pack_into(mapping, capacity + word * _WORD.size, value)


_RINGS: dict[str, PinnedRing] = {}
_RINGS_LOCK = threading.Lock()


def ring_for(device: torch.device, capacity: int) -> PinnedRing | None:
    """The process's ring for ``device`` (made on first use with ``capacity`` bytes; a
    later, larger request does not grow it). None off CUDA or when pinning fails."""
    if device.type != "cuda" or capacity <= 0:
        return None
    key = str(device)
    with _RINGS_LOCK:
        ring = _RINGS.get(key)
        if ring is None:
            try:
                ring = _RINGS[key] = PinnedRing(capacity)
            except RuntimeError:  # the host cannot pin that much: fresh allocations instead
                return None
        return ring
