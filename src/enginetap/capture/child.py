"""The capture writer process: ``python -m enginetap.capture.child FD CAPACITY ROOT BATCH PINNED``.

Started by :class:`~enginetap.capture.writers.ProcessWriter`; reads workload messages
(:mod:`~enginetap.capture.writers.wire`) on its standard input, maps the engine's shared
ring from descriptor ``FD`` and writes every workload with the thread writer's own code
(:class:`~enginetap.capture.writers.ThreadWriter`) into the dataset at ``ROOT``
(``PINNED`` 1: the engine pinned the ring, so its pages exist and are mapped at once),
making each receipt from the facts, labels and provenance the message carries. Which
workloads it is done with (written, refused or dropped) it tells through the ring's
control word: the highest ``seq`` up to which all are done. On standard output it
reports each workload the dataset refused (``refused``), the first write error
(``error``), and at the end its counts (``closed``). Its input closing (the engine's
process ended or went away) ends it after everything received is written.
"""

from __future__ import annotations

import logging
import mmap
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

import torch

from enginetap.capture.writers.copy import HostCopies
from enginetap.capture.writers.pinned import CONTROL_BYTES, set_control
from enginetap.capture.writers.provenance import Facts, Provenance
from enginetap.capture.writers import Item, ThreadWriter
from enginetap.capture.writers.wire import (DONE_WORD, REFUSALS_WORD, read_frame,
                                            rebuild_values, write_frame)
from enginetap.dataset import Dataset
from enginetap.dataset.schema import Definition, Receipt


class _Done:
    """Stands for a ring region in this process: releasing it marks the workload done;
    the control word moves up to the highest ``seq`` with every one before it done."""

    def __init__(self, progress: _Progress, seq: int) -> None:
        self.progress, self.seq = progress, seq

    def release(self) -> None:
        self.progress.done(self.seq)


class _Progress:
    def __init__(self, mapping: mmap.mmap, capacity: int) -> None:
        self.mapping, self.capacity = mapping, capacity
        self.through = -1
        self.refusals = -1
        self.early: set[int] = set()
        self.lock = threading.Lock()

    def done(self, seq: int) -> None:
        with self.lock:
            self.early.add(seq)
            through = self.through
            while through + 1 in self.early:
                through += 1
                self.early.discard(through)
            if through != self.through:
                self.through = through
                set_control(self.mapping, self.capacity, through, DONE_WORD)

    def refused(self) -> None:
        with self.lock:
            self.refusals += 1
            set_control(self.mapping, self.capacity, self.refusals, REFUSALS_WORD)


class _Report:
    def __init__(self, out: IO[bytes]) -> None:
        self.out = out
        self.lock = threading.Lock()

    def refused(self, seq: int, why: str, progress: _Progress) -> None:
        """Report a refused workload, then count it in the control words: the engine's
        process keeps the workload until it read the report."""
        self.send({"kind": "refused", "seq": seq, "why": why})
        progress.refused()

    def send(self, message: dict[str, Any]) -> None:
        with self.lock:
            try:
                write_frame(self.out, message)
            except (OSError, ValueError):
                pass  # the engine's process is gone: nothing left to tell


def _copies(values: dict[str, Any]) -> HostCopies:
    return HostCopies(values, nbytes=sum(v.numel() * v.element_size() for v in values.values()
                                         if isinstance(v, torch.Tensor)))


def _receipt(message: dict[str, Any], provenance: Provenance | None) -> Callable[[], Receipt]:
    """The workload's receipt, made when the writer writes it."""
    if "receipt" in message:
        receipt = Receipt.model_validate_json(message["receipt"])
        return lambda: receipt
    if provenance is None:
        raise ValueError("a workload's facts came before the provenance they need")
    facts, labels = Facts.from_json(message["facts"]), message["labels"]
    return lambda: provenance.receipt(facts, labels)


def main(argv: list[str]) -> int:
    fd, capacity, root, batch = int(argv[0]), int(argv[1]), Path(argv[2]), int(argv[3])
    pinned = len(argv) > 4 and argv[4] == "1"
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)  # the engine's process decides
    logging.basicConfig(format="%(levelname)s %(asctime)s [%(name)s] %(message)s",
                        datefmt="%m-%d %H:%M:%S")
    # a pinned ring's pages exist: map them all now (MAP_POPULATE) rather than fault 4 KiB
    # at a time (a selected H200 decode step copies 567 MB); an unpinned ring's pages are
    # made as the engine first writes them, and populating would make them all at once
    populate = getattr(mmap, "MAP_POPULATE", 0) if pinned else 0
    mapping = mmap.mmap(fd, capacity + CONTROL_BYTES, flags=mmap.MAP_SHARED | populate)
    ring = torch.frombuffer(mapping, dtype=torch.uint8, count=capacity)
    progress = _Progress(mapping, capacity)
    # the reports get standard output to themselves: anything printed goes to stderr
    report = _Report(os.fdopen(os.dup(1), "wb"))
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    writer = ThreadWriter(Dataset(root, create=True), budget_bytes=1 << 62, batch=batch)
    definitions: dict[str, Definition] = {}
    provenance: Provenance | None = None
    told_error = False
    source = sys.stdin.buffer
    while True:
        frame = read_frame(source)
        if frame is None:
            break
        message, payload = frame
        if message["kind"] == "close":
            break
        seq = message["seq"]
        if "definition_json" in message:
            definitions[message["definition"]] = Definition.model_validate_json(
                message["definition_json"])
        if "provenance" in message:
            provenance = Provenance.restore(message["provenance"])
        inputs = _copies(rebuild_values(message["inputs"], ring, payload))
        inputs.region = _Done(progress, seq)  # type: ignore[assignment]
        outputs = _copies(rebuild_values(message["outputs"], ring, payload))
        checks = (_copies(rebuild_values(message["checks"], ring, payload))
                  if "checks" in message else None)
        writer.submit(Item(definitions[message["definition"]], inputs, outputs,
                           _receipt(message, provenance),
                           lambda why, seq=seq: report.refused(seq, why, progress),
                           checks, tuple(message.get("check_notes", ()))))
        if writer.stats.error and not told_error:
            told_error = True
            report.send({"kind": "error", "error": writer.stats.error})
    stats = writer.close()
    report.send({"kind": "closed", "stats": asdict(stats)})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
