"""The thread writer: a background thread that batches captured workloads into a dataset.

The engine thread only hands over host copies (:meth:`~.base.CaptureWriter.submit`); the
writer thread waits for their copy events, then commits up to ``batch`` workloads at once.
A byte budget bounds what is held in memory: when it is full, ``wait`` blocks the engine
until the writer catches up, ``drop`` drops the workload and counts it. The writer is
flushed and joined by :meth:`close`, which the capture runtime calls at exit and on
SIGTERM/SIGINT.

The writer's work is Python (checks, safe paths, receipts, JSON) and holds the GIL, which
the engine thread gives up at every torch call; by default it then waits up to 5 ms (the
interpreter's switch interval) to get it back. While the writer has work it lowers the
switch interval to ``switch_interval_s`` and restores it when idle (on the H200, a decode
step with every call selected: 31.5 ms at 0.5 ms against 35.3 ms at Python's 5 ms;
BENCHMARKS.md).

A write error (disk full, permission, a refused workload) stops the writer: it is logged
once with what/why/fix, later workloads are counted as dropped, and the engine serves on.
One writer thread per dataset: the dataset store enforces it.

The engine thread and the writer share no lock (see :mod:`.base` for why).
"""

from __future__ import annotations

import logging
import sys
import threading

from enginetap.capture.writers.base import CaptureWriter, Item, WriterStats
from enginetap.dataset import Dataset, WorkloadRecord
from enginetap.dataset.checks import WorkloadProblems
from enginetap.dataset.writer import BatchProblems
from enginetap.errors import DatasetError

logger = logging.getLogger("enginetap.capture")

__all__ = ["ThreadWriter"]


class ThreadWriter(CaptureWriter):
    """See the module docstring. Raises nothing into the engine thread."""

    def __init__(self, dataset: Dataset, *, budget_bytes: int, when_full: str = "wait",
                 batch: int = 16, switch_interval_s: float = 0.0) -> None:
        super().__init__(budget_bytes=budget_bytes, when_full=when_full)
        self.dataset = dataset
        self.switch_interval_s = switch_interval_s
        self._restore_switch: float | None = None
        self.batch = self.per_look = batch
        self._thread = threading.Thread(target=self._run, name="enginetap-capture-writer",
                                        daemon=True)
        self._thread.start()

    def close(self, timeout: float | None = None) -> WriterStats:
        """Write everything submitted, stop the thread, and return the counts."""
        self._closed = True
        self._thread.join(timeout)
        return self.stats

    def _worker(self) -> threading.Thread:
        return self._thread

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            self._busy(False)

    def _work(self, items: list[Item]) -> None:
        self._busy(True)
        self._commit(items)

    def _rest(self) -> None:
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
