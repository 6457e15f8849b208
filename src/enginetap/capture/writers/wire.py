"""The pipe between the engine's process and the writer process: frames, and how a
workload travels in them.

A frame is two lengths, a JSON message and a binary payload. A workload's tensors do not
travel in it when they sit in the shared ring the child maps (a message names their
offsets); a tensor outside the ring, or a scalar, travels in the message or its payload
(:func:`describe_values`, :func:`rebuild_values`). What the child needs only once
(a definition, the provenance while it does not change) is sent once
(:class:`WorkloadEncoder`). The child tells which workloads it is done with through the
ring's control words (:data:`DONE_WORD`, :data:`REFUSALS_WORD`), not through a frame.
"""

from __future__ import annotations

import math
import struct
from typing import IO, Any

import orjson
import torch

from enginetap.capture.writers.pinned import PinnedRing
from enginetap.capture.writers.provenance import PendingReceipt
from enginetap.capture.writers.base import Item
from enginetap.dataset.blobs import byte_view
from enginetap.dataset.dtypes import name_of, torch_dtype

__all__ = ["DONE_WORD", "REFUSALS_WORD", "WorkloadEncoder", "describe_values", "frame",
           "read_frame", "rebuild_values", "widen_pipe", "write_frame"]

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


class WorkloadEncoder:
    """A workload's message, for one writer process: numbered in order (``seq``), with
    its definition and the provenance only when the child has not seen them. Leaves the
    receipt to the child: it sends the facts, the requests' labels and, when it changed,
    the provenance (a receipt made here is sent whole)."""

    def __init__(self, ring: PinnedRing) -> None:
        self.ring = ring
        self.seq = 0
        self._sent_definitions: set[str] = set()
        self._sent_provenance: tuple[int, int] | None = None

    def encode(self, item: Item, refreshed: set[int]) -> tuple[dict[str, Any], bytearray]:
        """``item``'s message and payload; ``refreshed``: the labels files already looked
        at in this send (one look per send)."""
        payload = bytearray()
        message: dict[str, Any] = {
            "kind": "workload", "seq": self.seq, "definition": item.definition.name,
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
            if id(receipt.labels) not in refreshed:
                receipt.labels.refresh()
                refreshed.add(id(receipt.labels))
            message["facts"] = receipt.facts
            message["labels"] = receipt.labels_now()
        else:
            message["receipt"] = receipt().model_dump_json()
        if item.definition.name not in self._sent_definitions:
            message["definition_json"] = item.definition.model_dump_json()
            self._sent_definitions.add(item.definition.name)
        self.seq += 1  # only for a message made whole: the child's progress has no gaps
        return message, payload


def widen_pipe(fd: int) -> None:
    """Let a step's messages fit in the pipe at once where Linux allows (fewer blocked
    writes, each a GIL round trip); the default 64 KiB otherwise."""
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    except (ImportError, OSError):
        pass
