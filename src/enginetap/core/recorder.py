"""Step recorder: every real step, as one JSON line, in this rank's ``steps-rank<r>.jsonl``.

It is an end listener of the step context, so it sees exactly the steps the engine
adapter published as real, and it lets anyone outside the engine's processes (a test,
a user) check the step context. Lines go through the one per-rank writer
(:mod:`enginetap.core.jsonl`) and its durability rule. ``enginetap vllm merge`` joins the ranks.
Engine-independent: every engine adapter's published steps look alike here.

When a step ends the line is written at once, unless the engine announces
:func:`~enginetap.core.context.device_wait` (a GPU engine): from the first announcement on,
a step's line is written at the next step's wait, while the device runs that step's
forward (a record sink, :mod:`enginetap.core.sink`). A decode step's line costs about
100 us of the engine thread's time right after a step on the H200 host (BENCHMARKS.md);
there it costs the step nothing while the host is ahead of the device. The last line
follows within :data:`~enginetap.core.sink.IDLE_S` (or at disarm and exit); a process
killed outright can lose the line of its last step, never a torn one.
"""

from __future__ import annotations

import logging
from dataclasses import fields, replace
from pathlib import Path

from enginetap.core import context
from enginetap.core.context import Step, StepRows
from enginetap.core.jsonl import RankJsonl
from enginetap.core.sink import RecordSink

logger = logging.getLogger("enginetap.recorder")

STEPS_FILE = "steps.jsonl"

__all__ = ["STEPS_FILE", "StepRecorder", "filter_rows"]


class StepRecorder:
    """Writes published steps of this process to ``<out_dir>/steps-rank<rank>.jsonl``.

    Only rows of requests whose id contains ``request_filter`` are written ("" keeps all);
    a step left without rows is skipped; with ``only_selected`` so is a step no capability
    selected. The file is created (truncated) at the first step written.
    """

    def __init__(self, out_dir: Path, rank: int, request_filter: str = "",
                 only_selected: bool = False) -> None:
        # fast: a step's record is ints and strings, written on the engine's thread
        self._writer = RankJsonl(Path(out_dir) / STEPS_FILE, rank, fast=True)
        self._sink = RecordSink(self._writer, deferred=True, on_error=self._failed,
                                name="enginetap-step-recorder")
        self.path = self._writer.path
        self.request_filter = request_filter
        self.only_selected = only_selected
        """Write only steps some capability selected (:meth:`Step.select`)."""
        self.deferring = False
        """Lines wait for the next step's device wait (the engine announced one)."""

    def install(self) -> StepRecorder:
        """Start recording: subscribe to the end of every published step (and to the
        engine's device waits, where the pending line is written)."""
        context.subscribe(on_end=self.write, on_wait=self.pump)
        return self

    def uninstall(self) -> None:
        """Stop recording; write what is pending and close the file."""
        context.unsubscribe(self.write)
        context.unsubscribe(self.pump)
        self._sink.close()

    def write(self, step: Step) -> None:
        """Append ``step`` (its matching rows) as one line, flushed: now, or at the next
        device wait once the engine announces them.

        A write error (unwritable or full output directory) is logged once and recording
        stops; the engine goes on.
        """
        if self.only_selected and not step.selected:
            return
        rows = filter_rows(step.rows, self.request_filter)
        if not len(rows):
            return
        record = step if rows is step.rows else replace(step, rows=rows)
        if self.deferring:
            self._sink.submit(record.to_json, step.step)
            return
        try:
            self._writer.write(record.to_json(), step=step.step)
        except OSError as exc:
            self._failed(exc)

    def pump(self, step: Step) -> None:
        """The engine waits for the device in ``step``: write the lines still pending."""
        self.deferring = True
        self._sink.pump()

    def _failed(self, exc: Exception) -> None:
        if not isinstance(exc, OSError):
            logger.error("enginetap: a step line was not written (%r); recording goes on",
                         exc)
            return
        context.unsubscribe(self.write)
        context.unsubscribe(self.pump)
        self._sink.stop()
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
