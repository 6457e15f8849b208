"""The capture writer in a child process (``options.capture.writer: process``).

The thread writer (:mod:`enginetap.capture.writer`) does its dataset work in the engine's
interpreter: its Python holds the GIL that the engine thread gives back at every torch
call. On the H200 that cost a decode step with every call selected 7.4 ms of 33.8
(BENCHMARKS.md). Here the dataset work runs in a child process, against the same
dataset code; the engine's process keeps only a sender thread (wait for a workload's
copies, build its receipt, send a small JSON message) and a receiver thread (give ring
space back as the child reports workloads done).

The tensors do not travel through the pipe: the engine copies them into a ring of shared
host memory (a memfd, pinned for the device where CUDA allows it) that the child maps,
and a message names their offsets. A tensor that found no room in the ring (or a scalar)
travels in the message. Messages are frames of a JSON header and a binary payload.

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
from enginetap.capture.writer import _POLL_S, Item, WriterStats, admit
from enginetap.dataset.blobs import byte_view
from enginetap.dataset.dtypes import name_of, torch_dtype

logger = logging.getLogger("enginetap.capture")

__all__ = ["ProcessWriter", "read_frame", "write_frame"]

_HEAD = struct.Struct("<II")


def write_frame(out: IO[bytes], message: dict[str, Any], payload: bytes = b"") -> None:
    """One frame: lengths, the JSON message, the payload (one write call)."""
    text = orjson.dumps(message)
    out.write(_HEAD.pack(len(text), len(payload)) + text + payload)
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
    as dropped, the engine serves on)."""

    def __init__(self, root: Path, *, budget_bytes: int, when_full: str = "wait",
                 batch: int = 16, pin: bool = True) -> None:
        self.root = root
        self.budget = budget_bytes
        self.when_full = when_full
        self.stats = WriterStats()
        self.ring = shared_ring(budget_bytes, pin=pin)
        self._pending: deque[Item] = deque()
        self._inflight: dict[int, Item] = {}
        self._sent_definitions: set[str] = set()
        self._seq = 0
        self._submitted = 0
        self._done = 0
        self._closed = False
        self._send_lock = threading.Lock()
        self._count_lock = threading.Lock()
        """Byte and drop counts are written by both the sender and the receiver thread."""
        # no device and no arming in the writer: it only writes files
        env = {k: v for k, v in os.environ.items() if not k.startswith("ENGINETAP_")}
        env["CUDA_VISIBLE_DEVICES"] = ""
        try:
            self._child = subprocess.Popen(
                [sys.executable, "-m", "enginetap.capture.child", str(self.ring.fd),
                 str(budget_bytes), str(root), str(batch)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(self.ring.fd,),
                env=env)
        finally:
            os.close(self.ring.fd)  # the child has its own; this process keeps its mapping
            self.ring.fd = -1
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
        if not self._receiver.is_alive():  # every workload released: nothing reads it now
            self.ring.unpin()
        return self.stats

    # ------------------------------------------------------------- sender thread
    def _send_loop(self) -> None:
        idle = _POLL_S
        while True:
            try:
                item = self._pending.popleft()
            except IndexError:
                if self._closed:
                    break
                time.sleep(idle)
                idle = min(idle * 2, 0.02)
                continue
            idle = _POLL_S
            self._send(item)
        self._write({"kind": "close"})
        try:
            self._child.stdin.close()  # type: ignore[union-attr]
        except OSError:
            pass

    def _send(self, item: Item) -> None:
        if self.stats.error:
            self._finish(item, dropped=True)
            return
        try:
            failed = item.failed_check()
            if failed is not None:
                with self._count_lock:
                    self.stats.refused += 1
                if item.refused is not None:
                    item.refused(failed)
                self._finish(item)
                return
            payload = bytearray()
            message = {"kind": "workload", "seq": self._seq,
                       "definition": item.definition.name,
                       "outputs": describe_values(item.outputs.wait(), self.ring, payload),
                       "inputs": describe_values(item.inputs.wait(), self.ring, payload),
                       "receipt": item.receipt().model_dump_json()}
            if item.definition.name not in self._sent_definitions:
                message["definition_json"] = item.definition.model_dump_json()
                self._sent_definitions.add(item.definition.name)
        except Exception as exc:  # noqa: BLE001 - our bug: stop capture, not the engine
            self._stop(f"{type(exc).__name__}: {exc}", "this is a bug in enginetap's capture "
                       "writer; report it with this message")
            self._finish(item, dropped=True)
            return
        self._inflight[self._seq] = item
        self._seq += 1
        self._write(message, bytes(payload))

    def _write(self, message: dict[str, Any], payload: bytes = b"") -> None:
        with self._send_lock:
            try:
                write_frame(self._child.stdin, message, payload)  # type: ignore[arg-type]
            except (OSError, ValueError):  # the child is gone: the receiver says why
                pass

    # ----------------------------------------------------------- receiver thread
    def _receive_loop(self) -> None:
        closed = False
        while True:
            frame = read_frame(self._child.stdout)  # type: ignore[arg-type]
            if frame is None:
                break
            message, _ = frame
            kind = message["kind"]
            if kind == "released":
                item = self._inflight.pop(message["seq"], None)
                if item is not None:
                    self._finish(item)
            elif kind == "refused":
                item = self._inflight.get(message["seq"])
                if item is not None and item.refused is not None:
                    item.refused(message["why"])
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
        for seq in list(self._inflight):
            self._finish(self._inflight.pop(seq), dropped=True)

    def _merge(self, child: dict[str, Any]) -> None:
        stats = self.stats
        stats.written += child["written"]
        stats.bytes_written += child["bytes_written"]
        stats.refused += child["refused"]
        stats.dropped_after_error += child["dropped_after_error"]
        stats.error = stats.error or child["error"]
        for name, count in child["per_definition"].items():
            stats.per_definition[name] = stats.per_definition.get(name, 0) + count

    def _finish(self, item: Item, dropped: bool = False) -> None:
        """``item`` is done with (sender or receiver thread): its ring space back."""
        item.release()
        with self._count_lock:
            if dropped:
                self.stats.dropped_after_error += 1
            self._done += item.nbytes

    def _stop(self, error: str, fix: str) -> None:
        if self.stats.error:
            return
        self.stats.error = error
        logger.error("enginetap capture: writing to %s failed, capture stops (the engine goes "
                     "on): %s. Fix: %s", self.root, error, fix)


def copies_for(values: dict[str, Any], writer: Any, ring_bytes: int) -> HostCopies:
    """Host copies of ``values`` for ``writer``: into its shared ring for a process
    writer, the process's pinned ring otherwise."""
    if isinstance(writer, ProcessWriter):
        return HostCopies.of(values, shared=writer.ring)
    return HostCopies.of(values, ring_bytes)
