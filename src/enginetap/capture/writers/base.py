"""What every capture writer shares: the workload on its way, the counts, and the engine
thread's side of the hand-over (admission under a byte budget).

A writer takes workloads from the engine thread (:meth:`CaptureWriter.submit`) and works
on them elsewhere: a thread of this process (:class:`~.thread.ThreadWriter`) or a child
process (:class:`~.process.ProcessWriter`). Both hand over through a ``deque`` (its append
and popleft are atomic) and keep byte counts each written by one thread only: SIGTERM and
SIGINT unwind the engine thread by raising wherever it is, and raised inside a
``queue.Queue`` or ``threading.Condition`` call that can leave the primitive's lock held
or a wake-up lost, so the flush at exit would wait forever (seen in tests). The worker
and a waiting engine thread poll at millisecond intervals instead.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from enginetap.capture.writers.copy import HostCopies
from enginetap.dataset.schema import Definition, Receipt

__all__ = ["CaptureWriter", "Item", "WriterStats"]

POLL_S = 0.001
"""How often a worker with work, or an engine thread waiting for budget, looks again."""
IDLE_MAX_S = 0.02
"""The longest an idle worker sleeps before looking for work (its latency when idle)."""


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


class CaptureWriter(ABC):
    """A writer's engine-thread side and its worker's polling loop. Subclasses start the
    worker, say which thread bounds a wait for budget (:meth:`_worker`) and what the
    worker does with landed workloads (:meth:`_work`). Raises nothing into the engine
    thread."""

    per_look: int = 1 << 62
    """The most landed workloads the worker takes at one look."""

    def __init__(self, *, budget_bytes: int, when_full: str = "wait") -> None:
        self.budget = budget_bytes
        self.when_full = when_full
        self.stats = WriterStats()
        self._pending: deque[Item] = deque()
        self._submitted = 0
        """Bytes handed over (written by the engine thread only)."""
        self._done = 0
        """Bytes written or dropped (written by the worker's side only)."""
        self._closed = False

    @property
    def held(self) -> int:
        """Bytes handed over and not yet written."""
        return self._submitted - self._done

    def submit(self, item: Item) -> bool:
        """Hand ``item`` over: dropped after an error or close, or when the budget is full
        and ``when_full`` is ``drop``; with ``wait`` the engine thread waits while the
        worker lives. False when it was dropped (counted)."""
        if self.stats.error or self._closed:
            self.stats.dropped_after_error += 1
            item.release()
            return False
        if self.held > 0 and self.held + item.nbytes > self.budget:
            if self.when_full == "drop":
                self.stats.dropped_full += 1
                item.release()
                return False
            worker = self._worker()
            while (self.held > 0 and self.held + item.nbytes > self.budget
                   and not self.stats.error and worker.is_alive()):
                time.sleep(POLL_S)
        self._submitted += item.nbytes
        self._pending.append(item)
        return True

    def host_copies(self, groups: list[dict[str, Any]], ring_bytes: int) -> list[HostCopies]:
        """Host copies of one workload's groups (inputs, outputs, checks) in the memory
        this writer reads: the process's pinned ring of ``ring_bytes`` here; one ring
        region and one event for all (:meth:`HostCopies.of_groups`)."""
        return HostCopies.of_groups(groups, ring_bytes)

    @abstractmethod
    def close(self, timeout: float | None = None) -> WriterStats:
        """Write everything submitted, stop the worker, and return the counts."""

    @abstractmethod
    def _worker(self) -> threading.Thread:
        """The thread whose death ends an engine thread's wait for budget."""

    @abstractmethod
    def _work(self, items: list[Item]) -> None:
        """Write (or send) ``items``, landed and in submission order (worker side)."""

    def _look(self) -> None:
        """Called before each look for landed workloads (worker side)."""

    def _rest(self) -> None:
        """Called before the worker sleeps with nothing to do."""

    def _serve(self) -> None:
        """The worker's loop: take the landed workloads in order and :meth:`_work` them;
        poll while copies are in flight; back off while idle; return once closed with
        nothing left."""
        idle = POLL_S
        while True:
            self._look()
            items = self._landed()
            if items:
                self._work(items)
                idle = POLL_S
            elif self._pending:  # copies still in flight
                time.sleep(POLL_S)
            elif self._closed:
                return  # closed, and nothing arrived since the last look
            else:
                self._rest()
                time.sleep(idle)
                idle = min(idle * 2, IDLE_MAX_S)

    def _landed(self) -> list[Item]:
        """Up to :attr:`per_look` pending workloads, in order, whose copies are done:
        waiting for a copy would give up the GIL and queue behind the engine thread to
        get it back."""
        items: list[Item] = []
        pending, most = self._pending, self.per_look
        while len(items) < most and pending and pending[0].landed():
            items.append(pending.popleft())
        return items
