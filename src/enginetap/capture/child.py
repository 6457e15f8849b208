"""The capture writer process: ``python -m enginetap.capture.child FD CAPACITY ROOT BATCH``.

Started by :class:`~enginetap.capture.procwriter.ProcessWriter`; reads workload messages
on its standard input, maps the engine's shared ring from descriptor ``FD`` and writes
every workload with the thread writer's own code (:class:`~enginetap.capture.writer.Writer`)
into the dataset at ``ROOT``. On standard output it reports each workload it is done with
(``released``), each the dataset refused (``refused``), the first write error
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
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

import torch

from enginetap.capture.copy import HostCopies
from enginetap.capture.procwriter import read_frame, rebuild_values, write_frame
from enginetap.capture.writer import Item, Writer
from enginetap.dataset import Dataset
from enginetap.dataset.schema import Definition, Receipt


class _Done:
    """Stands for a ring region in this process: releasing it tells the engine's process
    that the workload's ring space can be reused."""

    def __init__(self, report: _Report, seq: int) -> None:
        self.report, self.seq = report, seq

    def release(self) -> None:
        self.report.send({"kind": "released", "seq": self.seq})


class _Report:
    def __init__(self, out: IO[bytes]) -> None:
        self.out = out
        self.lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        with self.lock:
            try:
                write_frame(self.out, message)
            except (OSError, ValueError):
                pass  # the engine's process is gone: nothing left to tell


def _copies(values: dict[str, Any]) -> HostCopies:
    return HostCopies(values, nbytes=sum(v.numel() * v.element_size() for v in values.values()
                                         if isinstance(v, torch.Tensor)))


def main(argv: list[str]) -> int:
    fd, capacity, root, batch = int(argv[0]), int(argv[1]), Path(argv[2]), int(argv[3])
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)  # the engine's process decides
    logging.basicConfig(format="%(levelname)s %(asctime)s [%(name)s] %(message)s",
                        datefmt="%m-%d %H:%M:%S")
    ring = torch.frombuffer(mmap.mmap(fd, capacity), dtype=torch.uint8)
    # the reports get standard output to themselves: anything printed goes to stderr
    report = _Report(os.fdopen(os.dup(1), "wb"))
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    writer = Writer(Dataset(root, create=True), budget_bytes=1 << 62, batch=batch)
    definitions: dict[str, Definition] = {}
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
        receipt = Receipt.model_validate_json(message["receipt"])
        inputs = _copies(rebuild_values(message["inputs"], ring, payload))
        inputs.region = _Done(report, seq)  # type: ignore[assignment]
        outputs = _copies(rebuild_values(message["outputs"], ring, payload))
        writer.submit(Item(definitions[message["definition"]], inputs, outputs,
                           lambda receipt=receipt: receipt,
                           lambda why, seq=seq: report.send({"kind": "refused", "seq": seq,
                                                             "why": why})))
        if writer.stats.error and not told_error:
            told_error = True
            report.send({"kind": "error", "error": writer.stats.error})
    stats = writer.close()
    report.send({"kind": "closed", "stats": asdict(stats)})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
