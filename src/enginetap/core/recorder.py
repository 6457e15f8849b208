"""Step recorder: every real step, as one JSON line, in this rank's ``steps-rank<r>.jsonl``.

It is an end listener of the step context, so it sees exactly the steps the engine
adapter published as real, and it lets anyone outside the engine's processes (a test,
a user) check the step context. Each line is flushed when written, so a crashed
engine leaves every finished step on disk. ``enginetap vllm merge`` joins the ranks.
Engine-independent: every engine adapter's published steps look alike here.
"""

from __future__ import annotations

import json
import logging
from dataclasses import fields, replace
from pathlib import Path
from typing import IO

from enginetap.core import context
from enginetap.core.context import Step, StepRows
from enginetap.core.ranks import rank_path

logger = logging.getLogger("enginetap.recorder")

STEPS_FILE = "steps.jsonl"

__all__ = ["STEPS_FILE", "StepRecorder", "filter_rows"]


class StepRecorder:
    """Writes published steps of this process to ``<out_dir>/steps-rank<rank>.jsonl``.

    Only rows of requests whose id contains ``request_filter`` are written ("" keeps all);
    a step left without rows is skipped. The file is created (truncated) at the first step.
    """

    def __init__(self, out_dir: Path, rank: int, request_filter: str = "") -> None:
        self.path = rank_path(Path(out_dir) / STEPS_FILE, rank)
        self.request_filter = request_filter
        self._sink: IO[str] | None = None

    def install(self) -> StepRecorder:
        """Start recording: subscribe to the end of every published step."""
        context.subscribe(on_end=self.write)
        return self

    def uninstall(self) -> None:
        """Stop recording and close the file."""
        context.unsubscribe(self.write)
        if self._sink is not None:
            self._sink.close()
            self._sink = None

    def write(self, step: Step) -> None:
        """Append ``step`` (its matching rows) as one line and flush it.

        Raises:
            OSError: the output directory cannot be created or written (the step context
                contains listener errors, so the engine goes on).
        """
        rows = filter_rows(step.rows, self.request_filter)
        if not len(rows):
            return
        record = replace(step, rows=rows).to_json()
        sink = self._open()
        sink.write(json.dumps(record, separators=(",", ":")) + "\n")
        sink.flush()

    def _open(self) -> IO[str]:
        if self._sink is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._sink = self.path.open("w", encoding="utf-8")
        return self._sink


def filter_rows(rows: StepRows, request_filter: str) -> StepRows:
    """The rows whose request id contains ``request_filter`` ("" keeps ``rows`` itself)."""
    if not request_filter:
        return rows
    keep = [i for i, r in enumerate(rows.request_ids) if request_filter in r]
    picked = {}
    for column in fields(StepRows):
        values = getattr(rows, column.name)
        picked[column.name] = None if values is None else [values[i] for i in keep]
    return StepRows(**picked)
