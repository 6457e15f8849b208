"""Writing per-step records where the engine's host thread would wait anyway.

A record made at step end (the tap's fingerprints, the core step recorder's line) costs
host time on the engine's thread: encoding and a ``write``. Where a GPU runs the model
that time need not lengthen a step. A deferred sink keeps the record and writes it when
its owner calls :meth:`RecordSink.pump` at a moment the host would otherwise spend waiting
for the device: the next step, once its forward is queued (the step context's
``device_wait``, announced by the engine adapter), or the next step's end after the tap
queued its own kernels. (A background thread was tried first; it held the GIL against
the engine thread's launches and added about 19 ms of host time to a 41 ms decode step,
measured on the H200, BENCHMARKS.md.)

A record nobody picks up (the engine went idle) is written by a fallback thread after
:data:`IDLE_S`; at exit (SIGTERM and SIGINT included, :mod:`enginetap.core.shutdown`), at
close and at :meth:`RecordSink.drain` everything pending is written. A sink made with
``deferred=False`` writes each record as it is submitted.

Writing is serialized by a lock taken only without blocking (the engine thread never
waits on it; it writes at the next pump instead), so records stay in submission order
and a KeyboardInterrupt in the engine thread cannot leave a waiter behind.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from enginetap.core import shutdown
from enginetap.core.jsonl import STUCK_FLUSH_S, RankJsonl

logger = logging.getLogger("enginetap.sink")

__all__ = ["IDLE_S", "RecordSink"]

Job = tuple[Callable[[], dict[str, Any]], int, float]

IDLE_S = 0.5
"""A pending record older than this (no pump came) is written by the fallback thread."""

_POLL_S = 0.05
"""How often the fallback thread looks for records nobody picked up."""


class RecordSink:
    """Records of one writer, written in submission order.

    ``on_error`` receives an exception raised while a record was made or written (the
    record is lost, later ones are still written); without it the error is logged with
    its traceback. :meth:`stop` from there discards what is pending and what comes later.
    """

    def __init__(self, writer: RankJsonl, deferred: bool = True,
                 on_error: Callable[[Exception], None] | None = None,
                 name: str = "enginetap-sink") -> None:
        self.writer = writer
        self.deferred = deferred
        """Write at the next :meth:`pump`; False: at submission."""
        self.on_error = on_error
        self.name = name
        self._jobs: deque[Job] = deque()
        self._lock = threading.Lock()
        self._submitted = 0
        self._written = 0
        self._stopped = False
        self._stop = False
        self._thread: threading.Thread | None = None

    def submit(self, make: Callable[[], dict[str, Any]], step: int) -> None:
        """Write ``make()`` as the record of ``step`` (now, or at the next :meth:`pump`)."""
        if self._stopped:
            return
        self._submitted += 1
        self._jobs.append((make, step, time.monotonic()))
        if not self.deferred:
            self.drain()
            return
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._idle_writer, name=self.name,
                                            daemon=True)
            self._thread.start()
            # stuck exit: write what no other thread is writing, never wait for it
            # (an offloading writer's appender thread: a moment at most)
            shutdown.on_exit(self._at_exit, stuck=self._stuck)

    def pump(self) -> None:
        """Write what is pending, unless another thread is writing (then: next time).
        Called by the owner while the device finishes a step."""
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

    def _at_exit(self) -> None:
        self.drain()
        self.writer.flush()  # an offloading writer's lines (jsonl): on disk before exit

    def _stuck(self) -> None:
        self.pump()
        self.writer.flush(STUCK_FLUSH_S)

    def stop(self) -> None:
        """Discard pending records and ignore later ones (the output became unwritable)."""
        self._stopped = True
        self._jobs.clear()
        self._written = self._submitted

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
            shutdown.forget(self._at_exit)
        self.writer.close()

    def _write_pending(self) -> None:
        while True:
            try:
                make, step, _ = self._jobs.popleft()
            except IndexError:
                return
            try:
                self.writer.write(make(), step=step)
            except Exception as exc:  # a record lost must not stop the ones after it
                if self.on_error is None:
                    logger.exception("enginetap: record for %s not written", self.writer.path)
                else:
                    self.on_error(exc)
            finally:
                if not self._stopped:
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
