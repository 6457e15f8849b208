"""Capture writers: the engine thread hands workloads over; a thread of this process
(:class:`ThreadWriter`) or a child process (:class:`ProcessWriter`) writes them into the
dataset. Both are :class:`CaptureWriter` subclasses; :mod:`.wire` is the pipe to the child.
:mod:`.pinned` and :mod:`.copy` are the host memory workloads are copied into and
:mod:`.provenance` the receipts the writers make: they need nothing from ``capture/``."""

from __future__ import annotations

from enginetap.capture.writers.base import CaptureWriter, Item, WriterStats
from enginetap.capture.writers.process import ProcessWriter
from enginetap.capture.writers.thread import ThreadWriter

__all__ = ["CaptureWriter", "Item", "ProcessWriter", "ThreadWriter", "WriterStats"]
