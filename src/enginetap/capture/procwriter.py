"""The capture writer in a child process (``options.capture.writer: process``).

The thread writer (:mod:`enginetap.capture.writer`) does its dataset work in the engine's
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
travels in the message. Messages are frames of a JSON header and a binary payload.

Measured, it is slower than the thread writer on the H200 (a selected decode step 67–83
ms against 27–44 ms; the engine's own CPU work runs slower while the child runs, for a
reason not found) and on a 2-core CPU: opt-in, not the default (BENCHMARKS.md).

The child is ``python -m enginetap.capture.child``: it never initializes CUDA (its
environment hides the devices), ignores SIGINT and SIGTERM (the engine's process decides
when capture ends) and, when the engine's process goes away, writes what it received
and exits (its input closes). What it writes is exactly what the thread writer writes:
it runs :class:`~enginetap.capture.writer.Writer` on the received workloads.
"""

from __future__ import annotations

import logging
import math
import os
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import IO, Any

import orjson
import torch

from enginetap.capture.copy import HostCopies
from enginetap.capture.pinned import PinnedRing, shared_ring
from enginetap.capture.provenance import PendingReceipt
from enginetap.capture.writer import _IDLE_MAX_S, _POLL_S, Item, WriterStats, admit
from enginetap.dataset.blobs import byte_view
from enginetap.dataset.dtypes import name_of, torch_dtype

logger = logging.getLogger("enginetap.capture")

__all__ = ["ProcessWriter", "frame", "groups_for", "read_frame", "write_frame"]

_HEAD = struct.Struct("<II")
DONE_WORD, REFUSALS_WORD = 0, 1
"""The shared ring's control words the child sets: the highest ``seq`` up to which it
is done with every workload; how many refusals it reported (less one: they start at -1),
counted up before it is done with the refused workload."""


def frame(message: dict[str, Any], payload: bytes | bytearray = b"") -> bytes:
    """One frame: lengths, the JSON message (dataclasses in it as objects), the payload."""
    text = orjson.dumps(message)
    return _HEAD.pack(len(text), len(payload)) + text + payload


def write_frame(out: IO[bytes], message: dict[str, Any], payload: bytes = b"") -> None:
    """Write one :func:`frame` and flush it."""
    out.write(frame(message, payload))
    out.flush()


def read_frame(source: IO[bytes]) -> tuple[dict[str, Any], bytes] | None:
    """The next frame, or None at the end of the stream (a cut frame ends it too)."""
    head = source.read(_HEAD.size)
    if len(head) < _HEAD.size:
        return None
    text_len, payload_len = _HEAD.unpack(head)
    text = source.read(text_len)
    payload = source.read(payload_len) if payload_len else b""
    if len(text) < text_len or len(payload) < payload_len:
        return None
    return orjson.loads(text), payload


def describe_values(values: dict[str, Any], ring: PinnedRing,
                    payload: bytearray) -> dict[str, Any]:
    """``values`` as a message names them: ring offsets for tensors in ``ring``, bytes
    appended to ``payload`` for other tensors, scalars as they are."""
    out: dict[str, Any] = {}
    low, high = ring.base, ring.base + ring.capacity
    for name, value in values.items():
        if not isinstance(value, torch.Tensor):
            out[name] = {"scalar": value}
            continue
        dtype, shape = name_of(value.dtype), list(value.shape)
        nbytes = value.numel() * value.element_size()
        if value.is_contiguous() and low <= value.data_ptr() and value.data_ptr() + nbytes <= high:
            out[name] = {"ring": value.data_ptr() - low, "dtype": dtype, "shape": shape}
            continue
        host = value.detach().to("cpu").contiguous()
        out[name] = {"payload": len(payload), "nbytes": nbytes, "dtype": dtype, "shape": shape}
        if nbytes:
            payload += byte_view(host)
    return out


def rebuild_values(described: dict[str, Any], ring: torch.Tensor,
                   payload: bytes) -> dict[str, Any]:
    """The inverse of :func:`describe_values` in the child (``ring``: its mapping)."""
    out: dict[str, Any] = {}
    for name, entry in described.items():
        if "scalar" in entry:
            out[name] = entry["scalar"]
            continue
        dtype, shape = torch_dtype(entry["dtype"]), entry["shape"]
        nbytes = math.prod(shape) * dtype.itemsize
        if "ring" in entry:
            start = entry["ring"]
            raw = ring[start:start + nbytes]
        else:
            start = entry["payload"]
            raw = torch.frombuffer(bytearray(payload[start:start + nbytes]), dtype=torch.uint8) \
                if nbytes else torch.empty(0, dtype=torch.uint8)
        out[name] = raw.view(dtype).reshape(shape)
    return out


class ProcessWriter:
    """The writer's interface (:class:`~enginetap.capture.writer.Writer`), the work in a
    child process. Raises nothing into the engine thread; a child that cannot start or
    dies stops capture the way a write error does (logged once, later workloads counted
    as dropped, the engine serves on).

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
        self.root = root
        self.budget = budget_bytes
        self.when_full = when_full
        self.stats = WriterStats()
        self.ring = shared_ring(budget_bytes, pin=pin)
        self._pending: deque[Item] = deque()
        self._inflight: deque[tuple[int, Item]] = deque()
        self._sent_definitions: set[str] = set()
        self._sent_provenance: tuple[int, int] | None = None
        self._seq = 0
        self._refusals_read = -1
        self._submitted = 0
        self._done = 0
        self._closed = False
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
        _widen_pipe(self._out)
        self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                        name="enginetap-capture-sender")
        self._receiver = threading.Thread(target=self._receive_loop, daemon=True,
                                          name="enginetap-capture-receiver")
        self._sender.start()
        self._receiver.start()

    @property
    def held(self) -> int:
        return self._submitted - self._done

    def submit(self, item: Item) -> bool:
        """Hand ``item`` over; False when it was dropped (counted)."""
        return admit(self, item, self._receiver)

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

    # ------------------------------------------------------------- sender thread
    def _send_loop(self) -> None:
        idle = _POLL_S
        while True:
            self._reap()
            ready = self._landed()
            if ready:
                self._send(ready)
                idle = _POLL_S
            elif self._pending:  # copies still in flight
                time.sleep(_POLL_S)
            elif self._closed:
                break
            else:
                time.sleep(idle)
                idle = min(idle * 2, _IDLE_MAX_S)
        self._write(frame({"kind": "close"}))
        try:
            self._child.stdin.close()  # type: ignore[union-attr]
        except OSError:
            pass

    def _landed(self) -> list[Item]:
        """The pending workloads whose copies are done, in order (never waits)."""
        pending, ready = self._pending, []
        while pending and pending[0].landed():
            ready.append(pending.popleft())
        return ready

    def _send(self, items: list[Item]) -> None:
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
        payload = bytearray()
        message: dict[str, Any] = {
            "kind": "workload", "seq": self._seq, "definition": item.definition.name,
            "outputs": describe_values(item.outputs.values, self.ring, payload),
            "inputs": describe_values(item.inputs.values, self.ring, payload)}
        if item.checks is not None:
            message["checks"] = describe_values(item.checks.values, self.ring, payload)
            message["check_notes"] = list(item.check_notes)
        receipt = item.receipt
        if isinstance(receipt, PendingReceipt):
            provenance = receipt.provenance
            key = (id(provenance), id(provenance.model))  # the model is set when it loads
            if key != self._sent_provenance:
                message["provenance"] = provenance.state()
                self._sent_provenance = key
            if id(receipt.labels) not in refreshed:  # the labels file: one look per send
                receipt.labels.refresh()
                refreshed.add(id(receipt.labels))
            message["facts"] = receipt.facts
            message["labels"] = receipt.labels_now()
        else:
            message["receipt"] = receipt().model_dump_json()
        if item.definition.name not in self._sent_definitions:
            message["definition_json"] = item.definition.model_dump_json()
            self._sent_definitions.add(item.definition.name)
        self._seq += 1  # only for a message made whole: the child's progress has no gaps
        return message, payload

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


def _widen_pipe(fd: int) -> None:
    """Let a step's messages fit in the pipe at once where Linux allows (fewer blocked
    writes, each a GIL round trip); the default 64 KiB otherwise."""
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    except (ImportError, OSError):
        pass


def groups_for(groups: list[dict[str, Any]], writer: Any,
               ring_bytes: int) -> list[HostCopies]:
    """Host copies of one workload's groups (inputs, outputs, checks) for ``writer``: into
    its shared ring for a process writer, the process's pinned ring otherwise; one ring
    region and one event for all (:meth:`HostCopies.of_groups`)."""
    if isinstance(writer, ProcessWriter):
        return HostCopies.of_groups(groups, shared=writer.ring)
    return HostCopies.of_groups(groups, ring_bytes)
