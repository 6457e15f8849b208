"""Step recorder: every real step, as one JSON line, in this rank's ``steps-rank<r>.jsonl``.

It is an end listener of the step context, so it sees exactly the steps the engine
adapter published as real, and it lets anyone outside the engine's processes (a test,
a user) check the step context. Lines go through the one per-rank writer
(:mod:`enginetap.core.jsonl`) and its durability rule. ``enginetap vllm merge`` joins the ranks.
Engine-independent: every engine adapter's published steps look alike here.
"""

from __future__ import annotations

import logging
from dataclasses import fields, replace
from pathlib import Path

from enginetap.core import context
from enginetap.core.context import Step, StepRows
from enginetap.core.jsonl import RankJsonl

logger = logging.getLogger("enginetap.recorder")

STEPS_FILE = "steps.jsonl"

__all__ = ["STEPS_FILE", "StepRecorder", "filter_rows"]


class StepRecorder:
    """Writes published steps of this process to ``<out_dir>/steps-rank<rank>.jsonl``.

    Only rows of requests whose id contains ``request_filter`` are written ("" keeps all);
    a step left without rows is skipped. The file is created (truncated) at the first step.
    """

    def __init__(self, out_dir: Path, rank: int, request_filter: str = "") -> None:
        # fast: a step's record is ints and strings, written on the engine's thread
        self._writer = RankJsonl(Path(out_dir) / STEPS_FILE, rank, fast=True)
        self.path = self._writer.path
        self.request_filter = request_filter

    def install(self) -> StepRecorder:
        """Start recording: subscribe to the end of every published step."""
        context.subscribe(on_end=self.write)
        return self

    def uninstall(self) -> None:
        """Stop recording and close the file."""
        context.unsubscribe(self.write)
        self._writer.close()

    def write(self, step: Step) -> None:
        """Append ``step`` (its matching rows) as one line and flush it.

        A write error (unwritable or full output directory) is logged once and recording
        stops; the engine goes on.
        """
        rows = filter_rows(step.rows, self.request_filter)
        if not len(rows):
            return
        try:
            self._writer.write((step if rows is step.rows else replace(step, rows=rows)
                                ).to_json(), step=step.step)
        except OSError as exc:
            context.unsubscribe(self.write)
            logger.error("enginetap: cannot write %s (%s); step recording stops, the engine "
                         "goes on. Fix: point ENGINETAP_OUT / out_dir at a writable directory",
                         self.path, exc)


def filter_rows(rows: StepRows, request_filter: str) -> StepRows:
    """The rows whose request id contains ``request_filter`` ("" keeps ``rows`` itself)."""
    if not request_filter:
        return rows
    keep = [i for i, r in enumerate(rows.request_ids) if request_filter in r]
    picked: dict = {}
    for column in fields(StepRows):
        values = getattr(rows, column.name)
        if isinstance(values, dict):
            picked[column.name] = {g: [v[i] for i in keep] for g, v in values.items()}
        else:
            picked[column.name] = None if values is None else [values[i] for i in keep]
    return StepRows(**picked)
