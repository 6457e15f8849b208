"""Formatting and writing tap records where the engine's host thread would wait anyway.

At step end the recorder brings the hashes to the host (the step's one transfer). Turning
them into a JSON record and writing it costs about a millisecond and a half on a 289-
checkpoint step. Where a GPU runs the model (``deferred=True``) that work is done in the
engine thread at the *next* step's end, after that step's kernels are launched and before
its transfer waits for them: the host is idle there, waiting for the device. (A background
thread was tried first; it held the GIL against the engine thread's launches and added
about 19 ms of host time to a 41 ms decode step, measured on the H200, BENCHMARKS.md.)

A record nobody picks up (the engine went idle) is written by a fallback thread after
:data:`IDLE_S`; at exit, disarm and :meth:`RecordSink.drain` everything pending is written.
On a CPU engine there is no device to wait for: records are written at step end.

Writing is serialized by a lock taken only without blocking (the engine thread never
waits on it; it writes at the next step instead), so records stay in step order and a
KeyboardInterrupt in the engine thread cannot leave a waiter behind.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from enginetap.core.jsonl import RankJsonl

logger = logging.getLogger("enginetap.tap")

__all__ = ["IDLE_S", "RecordSink"]

Job = tuple[Callable[[], dict[str, Any]], int, float]

IDLE_S = 0.5
"""A pending record older than this (no next step came) is written by the fallback thread."""

_POLL_S = 0.05
"""How often the fallback thread looks for records nobody picked up."""


class RecordSink:
    """Records of one recorder, written in submission order."""

    def __init__(self, writer: RankJsonl, deferred: bool = True) -> None:
        self.writer = writer
        self.deferred = deferred
        """Write at the next step's :meth:`pump` (GPU); False: at submission."""
        self._jobs: deque[Job] = deque()
        self._lock = threading.Lock()
        self._submitted = 0
        self._written = 0
        self._stop = False
        self._thread: threading.Thread | None = None

    def submit(self, make: Callable[[], dict[str, Any]], step: int) -> None:
        """Write ``make()`` as the record of ``step`` (now, or at the next :meth:`pump`)."""
        self._submitted += 1
        self._jobs.append((make, step, time.monotonic()))
        if not self.deferred:
            self.drain()
            return
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._idle_writer,
                                            name="enginetap-tap-sink", daemon=True)
            self._thread.start()
            atexit.register(self.drain)

    def pump(self) -> None:
        """Write what is pending, unless another thread is writing (then: next time).
        Called by the recorder while the device finishes a step."""
        if self._jobs and self._lock.acquire(blocking=False):
            try:
                self._write_pending()
            finally:
                self._lock.release()

    def drain(self) -> None:
        """Write everything submitted (waits for a write in progress on another thread)."""
        while self._written < self._submitted:
            self.pump()
            if self._written < self._submitted:  # another thread is writing
                time.sleep(0.002)

    @property
    def pending(self) -> int:
        """Records submitted and not written yet."""
        return self._submitted - self._written

    def close(self) -> None:
        """Write what is pending, stop the fallback thread and close the file."""
        self.drain()
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop = True
            thread.join()
            atexit.unregister(self.drain)
        self.writer.close()

    def _write_pending(self) -> None:
        while True:
            try:
                make, step, _ = self._jobs.popleft()
            except IndexError:
                return
            try:
                self.writer.write(make(), step=step)
            except Exception:  # a record lost must not stop the ones after it
                logger.exception("enginetap: tap record not written")
            finally:
                self._written += 1

    def _idle_writer(self) -> None:
        while not self._stop:
            time.sleep(_POLL_S)
            try:
                oldest = self._jobs[0][2]
            except IndexError:
                continue
            if time.monotonic() - oldest > IDLE_S:
                self.pump()
