"""Formatting and writing tap records off the engine's step path.

At step end the recorder only brings the hashes to the host (the step's one transfer);
turning them into a JSON record and writing it happens on one background thread, in
submission order, through the per-rank writer. That pays where the host would otherwise
wait for the device (a GPU running the next step's kernels); on a CPU engine the thread
would only contend for the GIL and the cores, so there records are written inline.
:meth:`RecordSink.drain` waits for everything submitted (disarm, tests); at interpreter
exit the sink drains itself.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from enginetap.core.jsonl import RankJsonl

logger = logging.getLogger("enginetap.tap")

__all__ = ["RecordSink"]

Job = tuple[Callable[[], dict[str, Any]], int]


class RecordSink:
    """One background writer thread per recorder (started on first use)."""

    def __init__(self, writer: RankJsonl, background: bool = True) -> None:
        self.writer = writer
        self.background = background
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, make: Callable[[], dict[str, Any]], step: int) -> None:
        """Write ``make()`` as the record of ``step`` (later, in submission order, when
        ``background``)."""
        if not self.background:
            self.writer.write(make(), step=step)
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="enginetap-tap-sink",
                                                daemon=True)
                self._thread.start()
                atexit.register(self.drain)
        self._queue.put((make, step))

    def drain(self) -> None:
        """Wait until every submitted record is written."""
        if self._thread is not None:
            self._queue.join()

    def close(self) -> None:
        """Drain, stop the thread and close the file."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()
            atexit.unregister(self.drain)
        self.writer.close()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                make, step = job
                self.writer.write(make(), step=step)
            except Exception:  # a record lost must not stop the ones after it
                logger.exception("enginetap: tap record not written")
            finally:
                self._queue.task_done()
