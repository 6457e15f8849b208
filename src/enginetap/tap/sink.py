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
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from enginetap.core.jsonl import RankJsonl

logger = logging.getLogger("enginetap.tap")

__all__ = ["RecordSink"]

Job = tuple[Callable[[], dict[str, Any]], int]


class RecordSink:
    """One background writer thread per recorder (started on first use).

    The engine thread shares no lock with it: records are handed over through a ``deque``
    (atomic append and popleft) and the thread polls, so a KeyboardInterrupt raised in the
    engine thread mid-hand-over cannot leave a lock held or a wake-up lost for the exit
    drain (see :mod:`enginetap.capture.writer`, where that hang was seen)."""

    def __init__(self, writer: RankJsonl, background: bool = True) -> None:
        self.writer = writer
        self.background = background
        self._jobs: deque[Job] = deque()
        self._submitted = 0
        self._written = 0
        self._stop = False
        self._thread: threading.Thread | None = None

    def submit(self, make: Callable[[], dict[str, Any]], step: int) -> None:
        """Write ``make()`` as the record of ``step`` (later, in submission order, when
        ``background``)."""
        if not self.background:
            self.writer.write(make(), step=step)
            return
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._run, name="enginetap-tap-sink",
                                            daemon=True)
            self._thread.start()
            atexit.register(self.drain)
        self._submitted += 1
        self._jobs.append((make, step))

    def drain(self) -> None:
        """Wait until every submitted record is written."""
        while self._thread is not None and self._thread.is_alive() \
                and self._written < self._submitted:
            time.sleep(_POLL_S)

    def close(self) -> None:
        """Drain, stop the thread and close the file."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop = True
            thread.join()
            atexit.unregister(self.drain)
        self.writer.close()

    def _run(self) -> None:
        while True:
            try:
                make, step = self._jobs.popleft()
            except IndexError:
                if self._stop:
                    return
                time.sleep(_POLL_S)
                continue
            try:
                self.writer.write(make(), step=step)
            except Exception:  # a record lost must not stop the ones after it
                logger.exception("enginetap: tap record not written")
            finally:
                self._written += 1


_POLL_S = 0.002
"""How often the idle writer thread, or a drain, looks again."""
