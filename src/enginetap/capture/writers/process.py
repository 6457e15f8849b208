"""The capture writer in a child process (``options.capture.writer: process``).

The thread writer (:mod:`.thread`) does its dataset work in the engine's
interpreter: its Python holds the GIL that the engine thread gives back at every torch
call. On the H200 that cost a decode step with every call selected 7.4 ms of 33.8
(BENCHMARKS.md). Here the dataset work runs in a child process, against the same
dataset code; the engine's process keeps a sender thread (send the workloads whose
copies are done as small JSON messages; give ring space back as the child reports
workloads done) and a receiver thread (refusals, an error, the end). See
:class:`ProcessWriter` for why they make so few system calls.

The tensors do not travel through the pipe: the engine copies them into a ring of shared
host memory (a memfd, pinned for the device where CUDA allows it) that the child maps,
and a message names their offsets. A tensor that found no room in the ring (or a scalar)
travels in the message. The frames and messages are :mod:`.wire`'s.

Measured, it is slower than the thread writer on the H200 (a selected decode step 67–83
ms against 27–44 ms; the engine's own CPU work runs slower while the child runs, for a
reason not found) and on a 2-core CPU: opt-in, not the default (BENCHMARKS.md).

The child is ``python -m enginetap.capture.child``: it never initializes CUDA (its
environment hides the devices), ignores SIGINT and SIGTERM (the engine's process decides
when capture ends) and, when the engine's process goes away, writes what it received
and exits (its input closes). What it writes is exactly what the thread writer writes:
it runs :class:`~.thread.ThreadWriter` on the received workloads.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path
from typing import Any

from enginetap.capture.writers.copy import HostCopies
from enginetap.capture.writers.pinned import shared_ring
from enginetap.capture.writers.base import CaptureWriter, Item, WriterStats
from enginetap.capture.writers.wire import (DONE_WORD, REFUSALS_WORD, WorkloadEncoder, frame,
                                            read_frame, widen_pipe)

logger = logging.getLogger("enginetap.capture")

__all__ = ["ProcessWriter"]


class ProcessWriter(CaptureWriter):
    """A :class:`~.base.CaptureWriter` whose dataset work runs in a child process. Raises
    nothing into the engine thread; a child that cannot start or dies stops capture the
    way a write error does (logged once, later workloads counted as dropped, the engine
    serves on).

    What the engine's process does per workload is kept to a few dictionary lookups and
    one JSON encoding, and its threads make as few system calls as they can: each one
    gives up the GIL, and getting it back means queueing behind the engine thread (up to
    the interpreter's switch interval). So the sender never waits for a copy (it sends the
    workloads whose copies are done, in order, then sleeps), sends them all in one write,
    leaves the receipt to the child (it sends the facts, the requests' labels and, when it
    changed, the provenance), and learns which workloads the child is done with from the
    ring's control word, not from a message; the receiver thread wakes only for refusals,
    an error and the end."""

    def __init__(self, root: Path, *, budget_bytes: int, when_full: str = "wait",
                 batch: int = 16, pin: bool = True) -> None:
        super().__init__(budget_bytes=budget_bytes, when_full=when_full)
        self.root = root
        self.ring = shared_ring(budget_bytes, pin=pin)
        self._encoder = WorkloadEncoder(self.ring)
        self._inflight: deque[tuple[int, Item]] = deque()
        self._refusals_read = -1
        self._lock = threading.Lock()
        """Guards ``_inflight`` and the counts: the sender, the receiver and close()."""
        # no device, no arming and no compute thread pool in the writer: it only writes
        # files, and must not compete for cores with the engine's own thread pool
        env = {k: v for k, v in os.environ.items() if not k.startswith("ENGINETAP_")}
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        try:
            self._child = subprocess.Popen(
                [sys.executable, "-m", "enginetap.capture.child", str(self.ring.fd),
                 str(budget_bytes), str(root), str(batch), str(int(self.ring.pin))],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(self.ring.fd,),
                env=env)
        finally:
            os.close(self.ring.fd)  # the child has its own; this process keeps its mapping
            self.ring.fd = -1
        self._out = self._child.stdin.fileno()  # type: ignore[union-attr]
        widen_pipe(self._out)
        self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                        name="enginetap-capture-sender")
        self._receiver = threading.Thread(target=self._receive_loop, daemon=True,
                                          name="enginetap-capture-receiver")
        self._sender.start()
        self._receiver.start()

    def host_copies(self, groups: list[dict[str, Any]], ring_bytes: int) -> list[HostCopies]:
        """Host copies into the ring the child maps (``ring_bytes`` is not used)."""
        return HostCopies.of_groups(groups, shared=self.ring)

    def close(self, timeout: float | None = None) -> WriterStats:
        """Send everything, let the child write it and exit; return the counts."""
        self._closed = True
        self._sender.join(timeout)
        self._receiver.join(timeout)
        try:
            self._child.wait(timeout=5 if timeout is None else timeout)
        except subprocess.TimeoutExpired:
            self._child.kill()
        if not self._receiver.is_alive():  # the child is gone: nothing reads the ring now
            self._reap()
            self._drop_inflight()
            self.ring.unpin()
        return self.stats

    def _worker(self) -> threading.Thread:
        return self._receiver

    # ------------------------------------------------------------- sender thread
    def _send_loop(self) -> None:
        self._serve()
        self._write(frame({"kind": "close"}))
        try:
            self._child.stdin.close()  # type: ignore[union-attr]
        except OSError:
            pass

    def _look(self) -> None:
        self._reap()

    def _work(self, items: list[Item]) -> None:
        """Send the messages of ``items`` in one write."""
        frames = []
        refreshed: set[int] = set()
        for item in items:
            if self.stats.error:
                with self._lock:
                    self._finish(item, dropped=True)
                continue
            try:
                message, payload = self._message(item, refreshed)
            except Exception as exc:  # noqa: BLE001 - stop capture, not the engine
                device = any(copies.broken for copies in item.copies)
                self._stop(f"{type(exc).__name__}: {exc}", "the device failed; see the "
                           "engine's own error" if device else "this is a bug in enginetap's "
                           "capture writer; report it with this message")
                with self._lock:
                    self._finish(item, dropped=True)
                continue
            with self._lock:
                self._inflight.append((message["seq"], item))
            frames.append(frame(message, payload))
        if frames:
            self._write(b"".join(frames))

    def _message(self, item: Item, refreshed: set[int]) -> tuple[dict[str, Any], bytearray]:
        for copies in item.copies:
            if copies.broken:
                copies.wait()  # raises the device's error: capture stops, said once
        return self._encoder.encode(item, refreshed)

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._out, view):]
        except OSError:  # the child is gone: the receiver says why
            pass

    def _reap(self) -> None:
        """Give back the ring space of every workload the child is done with: those up
        to the control word it sets (a read of shared memory, no system call). Not while
        a refusal it reported is unread: the receiver needs the refused workload."""
        through = self.ring.control(DONE_WORD)
        if self.ring.control(REFUSALS_WORD) != self._refusals_read:
            return
        with self._lock:
            while self._inflight and self._inflight[0][0] <= through:
                self._finish(self._inflight.popleft()[1])

    # ----------------------------------------------------------- receiver thread
    def _receive_loop(self) -> None:
        closed = False
        while True:
            got = read_frame(self._child.stdout)  # type: ignore[arg-type]
            if got is None:
                break
            message, _ = got
            kind = message["kind"]
            if kind == "refused":
                with self._lock:
                    item = next((i for s, i in self._inflight if s == message["seq"]), None)
                if item is not None and item.refused is not None:
                    item.refused(message["why"])
                self._refusals_read += 1
            elif kind == "error" and not self.stats.error:
                self.stats.error = message["error"]  # the child logged it
            elif kind == "closed":
                closed = True
                self._merge(message["stats"])
        if not closed:
            code = self._child.wait()
            self._stop(f"the capture writer process exited (status {code}) before capture "
                       "ended", "see its error above; free disk space or fix the dataset "
                       "directory, then capture again")
            self._reap()
            self._drop_inflight()

    def _drop_inflight(self) -> None:
        with self._lock:
            while self._inflight:
                self._finish(self._inflight.popleft()[1], dropped=True)

    def _merge(self, child: dict[str, Any]) -> None:
        stats = self.stats
        with self._lock:
            stats.written += child["written"]
            stats.bytes_written += child["bytes_written"]
            stats.refused += child["refused"]
            stats.dropped_after_error += child["dropped_after_error"]
            stats.error = stats.error or child["error"]
            for name, count in child["per_definition"].items():
                stats.per_definition[name] = stats.per_definition.get(name, 0) + count

    def _finish(self, item: Item, dropped: bool = False) -> None:
        """``item`` is done with: its ring space back (callers hold ``_lock``)."""
        item.release()
        if dropped:
            self.stats.dropped_after_error += 1
        self._done += item.nbytes

    def _stop(self, error: str, fix: str) -> None:
        if self.stats.error:
            return
        self.stats.error = error
        logger.error("enginetap capture: writing to %s failed, capture stops (the engine goes "
                     "on): %s. Fix: %s", self.root, error, fix)
