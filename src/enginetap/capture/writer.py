"""The capture writer: a background thread that batches captured workloads into a dataset.

The engine thread only hands over host copies (:meth:`Writer.submit`); the writer thread
waits for their copy events, then commits up to ``batch`` workloads at once. A byte budget
bounds what is held in memory: when it is full, ``wait`` blocks the engine until the writer
catches up, ``drop`` drops the workload and counts it. The writer is flushed and joined by
:meth:`close`, which the capture runtime calls at exit and on SIGTERM/SIGINT.

The writer's work is Python (checks, safe paths, receipts, JSON) and holds the GIL, which
the engine thread gives up at every torch call; by default it then waits up to 5 ms (the
interpreter's switch interval) to get it back. While the writer has work it lowers the
switch interval to ``switch_interval_s`` and restores it when idle (on the H200, a decode
step with every call selected: 31.5 ms at 0.5 ms against 35.3 ms at Python's 5 ms;
BENCHMARKS.md).

A write error (disk full, permission, a refused workload) stops the writer: it is logged
once with what/why/fix, later workloads are counted as dropped, and the engine serves on.
One writer thread per dataset: the dataset store enforces it.

The engine thread and the writer share no lock. SIGTERM/SIGINT unwind the engine thread
by raising wherever it is (see :mod:`enginetap.capture.runtime`); raised inside a
``queue.Queue`` or ``threading.Condition`` call, that can leave the primitive's lock held
or a wake-up lost, and the flush at exit then waits forever (seen in tests). So the hand-over
is a ``deque`` (its append and popleft are atomic), byte counts are written each by one
thread only, and the writer and a waiting engine thread poll at millisecond intervals.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from enginetap.capture.copy import HostCopies
from enginetap.dataset import Dataset, WorkloadRecord
from enginetap.dataset.checks import WorkloadProblems
from enginetap.dataset.schema import Definition, Receipt
from enginetap.dataset.writer import BatchProblems
from enginetap.errors import DatasetError

logger = logging.getLogger("enginetap.capture")

__all__ = ["Item", "Writer", "WriterStats", "admit"]

_POLL_S = 0.001
"""How often a writer with work, or an engine thread waiting for budget, looks again."""
_IDLE_MAX_S = 0.02
"""The longest an idle writer sleeps before looking for work (its latency when idle)."""


@dataclass
class Item:
    """One workload on its way: host copies plus what makes its receipt. ``receipt`` is
    called on the writer thread; ``refused(message)`` when the dataset refuses the
    workload (a probe's adapter produced something its definition does not accept)."""

    definition: Definition
    inputs: HostCopies
    outputs: HostCopies
    receipt: Callable[[], Receipt]
    refused: Callable[[str], None] | None = None
    checks: HostCopies | None = None
    """The adapter's device-side checks (see :class:`~enginetap.capture.probe.Extracted`),
    one bool per entry of ``check_notes``."""
    check_notes: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.inputs.nbytes + self.outputs.nbytes

    @property
    def copies(self) -> tuple[HostCopies, ...]:
        """Every host copy the workload holds (inputs, outputs, device-side checks)."""
        if self.checks is None:
            return (self.inputs, self.outputs)
        return (self.inputs, self.outputs, self.checks)

    def landed(self) -> bool:
        """Whether every copy of the workload is done (never waits)."""
        return all(copies.landed() for copies in self.copies)

    def failed_check(self) -> str | None:
        """What the first failed device-side check means; None when all hold."""
        if self.checks is None:
            return None
        flags = self.checks.wait()
        for i, what in enumerate(self.check_notes):
            if not bool(flags[str(i)].all()):
                return f"the adapter's check failed: {what}"
        return None

    def release(self) -> None:
        """Give back pinned ring space (written, dropped or refused)."""
        for copies in self.copies:
            copies.release()


@dataclass
class WriterStats:
    written: int = 0
    bytes_written: int = 0
    dropped_full: int = 0
    dropped_after_error: int = 0
    refused: int = 0
    """Workloads the dataset refused (their probe is disabled)."""
    error: str = ""
    per_definition: dict[str, int] = field(default_factory=dict)


def admit(writer: Any, item: Item, worker: threading.Thread) -> bool:
    """The engine thread's side of a writer (this one or the process writer): drop
    ``item`` after an error or close, apply the budget (``drop``, or ``wait`` while
    ``worker`` lives), else queue it. False when it was dropped (counted)."""
    if writer.stats.error or writer._closed:
        writer.stats.dropped_after_error += 1
        item.release()
        return False
    if writer.held > 0 and writer.held + item.nbytes > writer.budget:
        if writer.when_full == "drop":
            writer.stats.dropped_full += 1
            item.release()
            return False
        while (writer.held > 0 and writer.held + item.nbytes > writer.budget
               and not writer.stats.error and worker.is_alive()):
            time.sleep(_POLL_S)
    writer._submitted += item.nbytes
    writer._pending.append(item)
    return True


class Writer:
    """See the module docstring. Raises nothing into the engine thread."""

    def __init__(self, dataset: Dataset, *, budget_bytes: int, when_full: str = "wait",
                 batch: int = 16, switch_interval_s: float = 0.0) -> None:
        self.dataset = dataset
        self.switch_interval_s = switch_interval_s
        self._restore_switch: float | None = None
        self.budget = budget_bytes
        self.when_full = when_full
        self.batch = batch
        self.stats = WriterStats()
        self._pending: deque[Item] = deque()
        self._submitted = 0
        """Bytes handed over (written by the engine thread only)."""
        self._done = 0
        """Bytes written or dropped by the writer (written by the writer thread only)."""
        self._thread = threading.Thread(target=self._run, name="enginetap-capture-writer",
                                        daemon=True)
        self._closed = False
        self._thread.start()

    @property
    def held(self) -> int:
        """Bytes handed over and not yet written."""
        return self._submitted - self._done

    def submit(self, item: Item) -> bool:
        """Hand ``item`` to the writer; False when it was dropped (counted)."""
        return admit(self, item, self._thread)

    def close(self, timeout: float | None = None) -> WriterStats:
        """Write everything submitted, stop the thread, and return the counts."""
        self._closed = True
        self._thread.join(timeout)
        return self.stats

    def _run(self) -> None:
        idle = _POLL_S
        try:
            while True:
                items = self._take()
                if items:
                    self._busy(True)
                    self._commit(items)
                    idle = _POLL_S
                elif self._pending:  # copies still in flight
                    time.sleep(_POLL_S)
                elif self._closed:
                    return  # closed, and nothing arrived since the last look
                else:
                    self._busy(False)
                    time.sleep(idle)
                    idle = min(idle * 2, _IDLE_MAX_S)
        finally:
            self._busy(False)

    def _busy(self, busy: bool) -> None:
        """Lower the switch interval while there is work; put it back when idle."""
        if not self.switch_interval_s:
            return
        if busy and self._restore_switch is None:
            current = sys.getswitchinterval()
            if current > self.switch_interval_s:
                self._restore_switch = current
                sys.setswitchinterval(self.switch_interval_s)
        elif not busy and self._restore_switch is not None:
            sys.setswitchinterval(self._restore_switch)
            self._restore_switch = None

    def _take(self) -> list[Item]:
        """Up to ``batch`` workloads, in order, whose copies are done: waiting for a copy
        would give up the GIL and queue behind the engine thread to get it back."""
        items: list[Item] = []
        pending = self._pending
        while len(items) < self.batch and pending and pending[0].landed():
            items.append(pending.popleft())
        return items

    def _commit(self, items: list[Item]) -> None:
        if not items:
            return
        try:
            if not self.stats.error:
                self._write(items)
        except Exception as exc:  # noqa: BLE001 - any failure stops capture, never the engine
            self.stats.error = f"{type(exc).__name__}: {exc}"
            self.stats.dropped_after_error += len(items)
            fix = ("free disk space or choose a writable dataset directory, then capture again"
                   if isinstance(exc, (OSError, DatasetError)) else
                   "this is a bug in enginetap's capture writer; report it with this message")
            logger.error("enginetap capture: writing to %s failed, capture stops (the engine "
                         "goes on): %s. Fix: %s", self.dataset.root, exc, fix,
                         exc_info=not isinstance(exc, (OSError, DatasetError)))
        finally:
            for item in items:
                item.release()
            self._done += sum(i.nbytes for i in items)

    def _write(self, items: list[Item]) -> None:
        """One batch commit; if the dataset refuses a record, the batch is written record
        by record so that only the refused workloads (and their probes) are dropped. A
        workload whose adapter's device-side check failed is refused first."""
        kept = []
        for item in items:
            failed = item.failed_check()
            if failed is None:
                kept.append(item)
            else:
                self._refuse(item, failed)
        if not kept:
            return
        items = kept
        records = [self._record(item) for item in items]
        try:
            self.dataset.add_workloads(records)
            self._count(items)
            return
        except (WorkloadProblems, BatchProblems) as exc:  # refused records: find which
            if len(items) == 1:
                self._refuse(items[0], str(exc))
                return
        for item, record in zip(items, records):
            try:
                self.dataset.add_workloads([record])
                self._count([item])
            except WorkloadProblems as exc:
                self._refuse(item, str(exc))

    def _record(self, item: Item) -> WorkloadRecord:
        outputs = item.outputs.wait()
        inputs = item.inputs.wait()
        return WorkloadRecord(definition=item.definition, inputs=inputs, outputs=outputs,
                              receipt=item.receipt())

    def _refuse(self, item: Item, why: str) -> None:
        self.stats.refused += 1
        if item.refused is not None:
            item.refused(why)

    def _count(self, items: list[Item]) -> None:
        for item in items:
            self.stats.written += 1
            self.stats.bytes_written += item.nbytes
            name = item.definition.name
            self.stats.per_definition[name] = self.stats.per_definition.get(name, 0) + 1
