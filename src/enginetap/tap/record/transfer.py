"""Step end: hash what the step staged and deferred, bring hashes and sampler values to
the host in one transfer per device, and format the JSONL record (off the step path
where a GPU runs the model, :mod:`enginetap.core.sink`); the header once per file."""

from __future__ import annotations

import logging
import math
import operator
import platform
from typing import Any

import numpy as np
import torch

from enginetap.core.capability import ArmContext
from enginetap.core.context import Step
from enginetap.core.jsonl import Encoded, NonFinite
from enginetap.core.sink import RecordSink
from enginetap.core.tensors import capturing
from enginetap.tap.options import TapOptions
from enginetap.tap.record.checkpointer import Checkpointer
from enginetap.tap.record.deferred import DeferredHashes
from enginetap.tap.record.ledger import StepLedger
from enginetap.tap.record.vectors import VectorDump
from enginetap.tap.schema import header_record, step_record

__all__ = ["Transfer", "header"]

logger = logging.getLogger("enginetap.tap")

Launched = tuple[torch.device, list[str], torch.Tensor, torch.Tensor, list[torch.Tensor]]
"""One device's step end: its names, verification flags, everything to bring to the host
in one tensor, and the sampler values in it."""


_DEVICE = operator.itemgetter(0)
_NAME = operator.itemgetter(1)


class Transfer:
    """The recorder's step end: hashes to the host, records to the ``sink`` (``vectors``:
    the raw rows dumped beside, where asked for)."""

    __slots__ = ("sink", "vectors", "flags")

    def __init__(self, sink: RecordSink, vectors: VectorDump | None) -> None:
        self.sink = sink
        self.vectors = vectors
        self.flags: list[tuple[torch.cuda.Event, torch.Tensor, DeferredHashes | None,
                               list[str]]] = []
        """Verification flags of the last step whose hashes were queued without waiting,
        with the names they verify (see :meth:`_later`)."""

    def step_end(self, step: Step, ledger: StepLedger, checkpointer: Checkpointer,
                 compiled: Any) -> Any:
        """Hash what ``step`` staged and deferred (its ``ledger``, ``checkpointer``'s
        devices; ``compiled``: a compiled tap's buffer, or None) and bring it to the host
        (one transfer per device, one device in practice); returns the function that
        formats the record from it."""
        by_device: dict[torch.device, list[tuple[str, int]]] = {}
        devices = set(map(_DEVICE, ledger.names))
        if len(devices) == 1:  # in practice: one list, made in C
            by_device[devices.pop()] = list(zip(map(_NAME, ledger.names), ledger.slots))
        else:
            for (device, name), slot in zip(ledger.names, ledger.slots):
                by_device.setdefault(device, []).append((name, slot))
        host: list[tuple[list[str], torch.Tensor, int]] = []
        dropped: list[str] = []
        k = len(ledger.rows)
        launched = []
        for device, entries in by_device.items():
            hashes, names, checks = _device_hashes(ledger, checkpointer, device, entries,
                                                   dropped)
            extra = [p.flatten() for d, p in ledger.sampler if d == device]
            launched.append((device, names, checks,
                             torch.cat([hashes.flatten(), checks, *extra]), extra))
        gone = set(dropped)
        order = [name for _, name in ledger.names if name not in gone] if gone else \
            list(map(_NAME, ledger.names))
        head = {"kind": "step", "mode": step.mode, "engine": step.engine, "rows": ledger.rows,
                "checkpoints": order, "sampled": dict(step.sampled)}
        dropped += ledger.late_dropped
        if dropped:
            head["dropped"] = dropped
        sampler = ledger.sampler
        if compiled is not None:  # hashed in the graph: one read of its buffer
            queued, compiled.queued = compiled.queued, None
            if queued is not None:  # on its way since the device wait (with the sampler's)
                sampler = sampler[queued.extras:]
                if not launched and not sampler and self.vectors is None:
                    return self._landed(compiled, queued, head, k)
            host.append(_compiled_part(compiled, queued, k, head))
        if (self.vectors is None and launched and compiled is None
                and all(d.type == "cuda" for d, *_ in launched)
                and all(d in by_device for d, _ in sampler)):
            return self._later(launched, head, k, checkpointer)
        self.apply_flags()
        # The previous step's record is written now, while the device finishes this step.
        self.sink.pump()
        for device, names, checks, on_device, extra in launched:
            flat = on_device.cpu()
            if checks.numel():
                deferred = checkpointer.deferred[device]
                assert deferred is not None
                deferred.compare_flags(flat[len(names) * k:len(names) * k + checks.numel()])
                flat = torch.cat([flat[:len(names) * k], flat[len(names) * k + checks.numel():]])
            host.append((names, flat, len(extra)))
            if self.vectors is not None:
                self.vectors.maybe_dump(step.step, ledger.rows, names,
                                        checkpointer.staging[device], flat[:len(names) * k])
        host += [([], p.flatten().cpu(), 1) for d, p in sampler if d not in by_device]
        return lambda: _format(head, host, k)

    def _landed(self, compiled: Any, queued: Any, head: dict[str, Any], k: int) -> Any:
        """A compiled or graph-replayed step whose buffer and sampler values were queued to
        the host at the device wait (:meth:`.CompiledTap.queue`) and that has nothing else
        to bring: the record is made from them when it is written (off the step's path,
        the copy long landed)."""
        self.apply_flags()
        self.sink.pump()
        return lambda: _format(head, [_compiled_part(compiled, queued, k, head)], k)

    def _later(self, launched: list[Launched], head: dict[str, Any], k: int,
               checkpointer: Checkpointer) -> Any:
        """On a GPU: queue the step's hashes into pinned host memory without waiting for
        them. The engine has already synchronized for its sampled tokens, so the device
        would otherwise sit idle through the hash kernel, the transfer and the wait while
        the host plans the next step; this way they overlap it. The record is formatted
        when it is written (the next step's end, or the sink's idle writer), after the
        copy's event; the verification flags are read by the engine's thread at the next
        step's end (or when the tap is removed)."""
        copies = []
        for device, names, checks, on_device, extra in launched:
            host = torch.empty(on_device.shape, dtype=on_device.dtype, pin_memory=True)
            host.copy_(on_device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            copies.append((event, device, names, checks.numel(), host, len(extra)))
        self.apply_flags()  # the previous step's: landed long ago
        self.flags = [(event, host[len(names) * k:len(names) * k + n],
                       checkpointer.deferred[device], _checked(checkpointer, device))
                      for event, device, names, n, host, _ in copies if n]
        self.sink.pump()  # the previous step's record, while the device works on this one

        def make() -> dict[str, Any]:
            host_list = []
            for event, _, names, n, host, extras in copies:
                event.synchronize()
                flat = host
                if n:
                    flat = torch.cat([host[:len(names) * k], host[len(names) * k + n:]])
                host_list.append((names, flat, extras))
            return _format(head, host_list, k)

        return make

    def apply_flags(self) -> None:
        """Demote the deferred checkpoints whose verification failed in the step whose
        hashes were queued last (its flags read once its copy landed)."""
        flags, self.flags = self.flags, []
        for event, equal, deferred, names in flags:
            event.synchronize()
            if deferred is not None:
                deferred.compare_flags(equal, names)


def _compiled_part(compiled: Any, queued: Any, k: int, head: dict[str, Any]
                   ) -> tuple[list[str], torch.Tensor, int]:
    """A compiled tap's names and flat hashes on the host (then the sampler values
    ``queued`` with them, if any), its names put first in ``head``'s checkpoints."""
    names, hashes, extra = compiled.collect(k, queued)
    head["checkpoints"] = names + head["checkpoints"]
    flat = hashes.flatten()
    return (names, flat if extra is None else torch.cat([flat, extra]),
            0 if queued is None else queued.extras)


def _checked(checkpointer: Checkpointer, device: torch.device) -> list[str]:
    """The names this step verified on ``device``, in the order of its flags."""
    deferred = checkpointer.deferred.get(device)
    return [] if deferred is None else [name for name, _, _ in deferred.checks]


def _device_hashes(ledger: StepLedger, checkpointer: Checkpointer, device: torch.device,
                   entries: list[tuple[str, int]], dropped: list[str]
                   ) -> tuple[torch.Tensor, list[str], torch.Tensor]:
    """One device's ``[checkpoints, rows]`` hashes in checkpoint order (staged and
    deferred merged; deferred tensors modified since their checkpoint left out and
    named in ``dropped``), the names kept, and the verification flags (int64, 1 where
    a verified checkpoint's deferred hash equals its staged one)."""
    staging = checkpointer.staging.get(device)
    staged = staging.hashes() if staging is not None else \
        torch.zeros((0, len(ledger.rows)), dtype=torch.int64, device=device)
    deferred = checkpointer.deferred.get(device)
    no_checks = torch.zeros(0, dtype=torch.int64, device=device)
    if deferred is None or not deferred.names:
        return staged, [name for name, _ in entries], no_checks
    moved = set(deferred.moved())
    order, names = [], []
    for name, slot in entries:
        if slot < 0 and -1 - slot in moved:
            dropped.append(name)
            continue
        order.append(slot if slot >= 0 else staged.shape[0] - 1 - slot)
        names.append(name)
    if not staged.shape[0] and len(order) == len(deferred.names):
        # all deferred, none dropped: hashed in checkpoint order (a quick step's cache
        # columns, kept at their call, precede in slot order the checkpoints it kept
        # after the forward; the table is put in order, the hashes need no gather)
        deferred.arrange(order)
        return deferred.hashes(ledger.device_list("rows", device)), names, no_checks
    later = deferred.hashes(ledger.device_list("rows", device))
    merged = torch.cat([staged, later]).index_select(
        0, torch.tensor(order, dtype=torch.int64).to(device, non_blocking=True))
    checks = no_checks
    if deferred.checks:
        pairs = torch.tensor([(s, d) for _, s, d in deferred.checks], dtype=torch.int64)
        pairs = pairs.to(device, non_blocking=True)
        checks = (staged.index_select(0, pairs[:, 0]) == later.index_select(0, pairs[:, 1])
                  ).all(dim=1).to(torch.int64)
    return merged, names, checks


def header(context: ArmContext, options: TapOptions, models: list[dict[str, Any]],
           compiled: Any, step: Step) -> dict[str, Any]:
    """The tap file's header record, written before ``step``'s (``compiled``: a compiled
    tap, or None)."""
    hooks = context.hooks
    record = header_record(
        engine=step.engine, engine_version=hooks.engine_version(),
        world_size=context.world_size, tp_size=context.world_size,
        kv_block_size=step.kv_block_size, models=models,
        cache_groups=step.extra.get("cache_groups"),
        options=options.model_dump(),
        compiled=step.extra.get("compiled") or torch.compiler.is_compiling(),
        cuda_graphs=capturing(), eager=not capturing(),
        torch=torch.__version__, host=platform.node(),
    )
    if compiled is not None:  # compiled / CUDA-graph tap (tap/record/compiled.py)
        record.update(compiled.header())
    if step.extra.get("compiled") and compiled is None:
        logger.warning("tap: the engine compiles the model (%s): checkpoints of modules "
                       "inside the compiled forward are not recorded (torch.compile "
                       "inlines past their hooks); kernel-level points in custom ops and "
                       "the sampler are. Run the engine eager (vLLM: enforce_eager=True) "
                       "to tap every sublayer", step.extra["compiled"])
    return record


def _format(head: dict[str, Any], host: list[tuple[list[str], torch.Tensor, int]],
            k: int) -> dict[str, Any]:
    """The step's record from ``head`` and the hashes and sampler values on the host:
    per device, its names and one flat int64 tensor (hashes ``[names, k]``, then 4
    sampler words per row where ``extra``)."""
    tables: list[np.ndarray] = []
    listed: list[str] = []
    sampler: list[dict[str, Any]] = []
    finite = True
    for names, flat, extra in host:
        words = flat.numpy()
        tables.append(words[:len(names) * k].reshape(len(names), k))
        listed += names
        if extra:
            tail = words[len(names) * k:(len(names) + 4) * k]
            sampler, finite = _sampler_rows(memoryview(np.ascontiguousarray(tail)).cast("B"), k)
    order = head["checkpoints"]
    table = tables[0] if len(tables) == 1 else np.concatenate(tables) if tables else \
        np.zeros((0, k), dtype=np.int64)
    if listed != order:  # several devices, or a compiled tap's names first
        at = {name: i for i, name in enumerate(listed)}
        table = table[[at[name] for name in order]]
    record = step_record(**head, hashes=Encoded(_hex_list(table)), sampler=sampler)
    # The sampler's logits are the record's only floats; a masked vocabulary (constrained
    # decoding) makes them infinite, which only json writes as they are.
    return record if finite else NonFinite(record)


_HEX = np.frombuffer("".join(f"{i:02x}" for i in range(256)).encode(), dtype=np.uint16)
"""Per byte value, its two lowercase hex digits (ASCII) as one uint16 (512 bytes: in the
first-level cache after one use)."""


def _hex_list(table: np.ndarray) -> bytes:
    """``table`` (int64 ``[checkpoints, rows]``) as the record's ``hashes``, encoded: a
    JSON list of one string per checkpoint, 16 hex digits per row (the row's 64 bits,
    big-endian), built in a few numpy passes over the whole table (no Python string
    per checkpoint)."""
    n, k = table.shape
    if not n:
        return b"[]"
    width = 16 * k
    digits = _HEX.take(np.ascontiguousarray(table, dtype=">u8").view(np.uint8))
    line = np.empty(1 + n * (width + 3), dtype=np.uint8)
    line[0] = ord("[")
    body = line[1:].reshape(n, width + 3)
    body[:, 0] = body[:, width + 1] = ord('"')
    body[:, width + 2] = ord(",")
    body[:, 1:width + 1] = digits.view(np.uint8).reshape(n, width)
    body[-1, -1] = ord("]")
    return line.tobytes()


def _sampler_rows(packed: memoryview, k: int) -> tuple[list[dict[str, Any]], bool]:
    """Per row, its sampler record from its 4 words in ``packed`` (bytes: argmax,
    runner-up, and the top two logits' float64 bits, native order); whether every logit
    is finite."""
    ints, floats = packed.cast("q").tolist(), packed.cast("d").tolist()
    rows = [{"argmax": ints[i], "runner_up": ints[i + 1], "top1": floats[i + 2],
             "top2": floats[i + 3], "gap": floats[i + 2] - floats[i + 3]}
            for i in range(0, 4 * k, 4)]
    return rows, all(map(math.isfinite, floats[2::4] + floats[3::4]))
