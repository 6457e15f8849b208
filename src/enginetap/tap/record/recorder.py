"""The per-step tap: the recorder's lifecycle, one record per step.

Step begin picks the tapped rows; every checkpoint during the step gathers those rows'
bytes into the step's staging buffer (:mod:`.checkpointer`, :mod:`.staging`), or, on a
GPU, keeps the tensor to hash in place at step end (:mod:`.deferred`; settled steps run
quick, :mod:`.quick`); step end hashes them all and brings hashes and sampler values to
the host in one transfer (:mod:`.transfer`); the JSONL record is formatted and written off
the step path where a GPU runs the model (:mod:`enginetap.core.sink`). Outside a step
(warm-up, dummy runs) every checkpoint is a no-op.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from enginetap.core.capability import ArmContext
from enginetap.core.context import Step, subscribe, unsubscribe
from enginetap.core.jsonl import RankJsonl
from enginetap.core.sink import RecordSink
from enginetap.tap.options import TapOptions
from enginetap.tap.record.checkpointer import Checkpointer
from enginetap.tap.record.deferred import DeferredHashes
from enginetap.tap.record.quick import QuickPlan, QuickSteps
from enginetap.tap.record.staging import StepStaging
from enginetap.tap.record.transfer import Transfer
from enginetap.tap.record.rows import PrefixTracker, fill_late_lengths, row_records, select_rows
from enginetap.tap.record.vectors import VectorDump

logger = logging.getLogger("enginetap.tap")

__all__ = ["TapRecorder"]


class TapRecorder(Checkpointer, QuickSteps, Transfer):
    """One per armed process; subscribed to the step context while installed."""

    def __init__(self, context: ArmContext, options: TapOptions) -> None:
        self.context = context
        self.options = options
        self.writer = RankJsonl(context.out_dir / f"{options.file}.jsonl", context.rank,
                                fast=True)  # see _format
        self.sink = RecordSink(self.writer, deferred=torch.cuda.is_available(),
                               name="enginetap-tap-sink")
        self.vectors = VectorDump.from_options(context.out_dir, context.rank, options)
        self.filters = [options.request_filter, context.config.request_filter]
        self.prefixes = PrefixTracker()
        self.models: list[dict[str, Any]] = []
        self.refused: set[str] = set()
        self.failures = 0
        """Errors the tap's own wrappers caught (each call went on; the first is logged)."""
        self._header = False
        self.last_checkpoints = 0
        """Checkpoints recorded in the last step (benchmarks, logs)."""
        self.last_bytes = 0
        """Bytes staged and hashed in the last step."""
        self.last_deferred = 0
        """Checkpoints of the last step hashed in place at step end (the rest gathered)."""
        self._staging: dict[torch.device, StepStaging] = {}
        self._deferred: dict[torch.device, DeferredHashes | None] = {}
        self._fast: dict[int, DeferredHashes] = {}
        """The devices whose checkpoints are deferred, by ``Tensor.get_device()`` index
        (the checkpoint's fast path: no ``torch.device`` made per call)."""
        self._defer = options.defer and options.vectors == "off"
        self._cuda = torch.cuda.is_available()
        self._forced = options.force
        self._flags: list[tuple[torch.cuda.Event, torch.Tensor, DeferredHashes | None,
                                list[str]]] = []
        """Verification flags of the last step whose hashes were queued without waiting,
        with the names they verify (see :meth:`_transfer_later`)."""
        self.quick_steps = True
        """Run settled steps quick (see :meth:`_start_quick`); False: every checkpoint is
        examined as it comes (benchmarks compare the two)."""
        self.at_call: set[str] = set()
        """Checkpoint names examined as they come even in a quick step: those gathered
        rather than deferred (demoted, or of a layout deferral does not take). The
        sublayer wrappers test it per call; it only changes at a step's begin."""
        self._at_call_next: set[str] = set()
        self._demotions = 0
        self._settled: set[str] = set()
        """Step kinds whose last step verified nothing: their next steps may run quick."""
        self.quick_count = 0
        """Steps run quick since install (benchmarks, tests)."""
        self.planned_count = 0
        """Quick steps whose list was kept whole by its plan (benchmarks, tests)."""
        self._plans: dict[str, QuickPlan] = {}
        """By step kind: the plan of its last quick step's list (see :class:`QuickPlan`)."""
        self.last_quick = False
        self.compiled: Any = None
        """A compiled engine's checkpoints (:class:`~enginetap.tap.record.compiled.CompiledTap`),
        hashed in the graph and collected at step end."""
        self._clear()

    def _clear(self) -> None:
        self.step: Step | None = None
        self._pending: Step | None = None
        """The step whose rows are not picked yet (see :meth:`begin`)."""
        self.padded = 0
        self._rows: list[dict[str, Any]] = []
        self.token_index: list[int] = []
        self.names: list[tuple[torch.device, str]] = []
        self.slots: list[int] = []
        """Per name: its slot in its device's staging order (>= 0), or ``-1 - i`` for the
        ``i``-th deferred checkpoint of the step."""
        self.counts: dict[str, int] = {}
        self.sampler: list[tuple[torch.device, torch.Tensor]] = []
        self.request_of_row: list[int] = []
        self.request_token_index: list[int] = []
        self._index: dict[tuple[str, torch.device], torch.Tensor] = {}
        self.quick: list[tuple[str | None, Any]] | None = None
        """In a quick step: the checkpoints taken so far, in order — ``(name, tensor or
        tuple of outputs)`` to examine at the device wait or step end, or ``(None,
        (device, name, slot))`` for one examined at its call."""
        self.late_dropped: list[str] = []
        """Checkpoints of this quick step that could not be deferred when examined."""
        self.quick_step = False
        """This step runs quick (its list may already be examined: :attr:`quick` None)."""

    def install(self) -> TapRecorder:
        subscribe(on_begin=self.begin, on_end=self.end, on_wait=self.waiting)
        return self

    def uninstall(self) -> None:
        unsubscribe(self.begin)
        unsubscribe(self.end)
        unsubscribe(self.waiting)
        if self.compiled is not None:  # its hooks leave the compiled model
            self.compiled.detach()
        self._clear()
        self._apply_flags()
        self.sink.close()

    def model_loaded(self, model: Any) -> None:
        config = getattr(model, "config", None)
        dtype = next((str(p.dtype) for p in model.parameters()), None)
        self.models.append({"class": type(model).__name__, "dtype": dtype,
                            "model_type": getattr(config, "model_type", None),
                            "layers": getattr(config, "num_hidden_layers", None)})
        self._settled.clear()  # its checkpoint names are verified before any quick step
        self._plans.clear()

    @property
    def active(self) -> bool:
        return self.step is not None

    @property
    def live(self) -> bool:
        """Whether this step taps any row (picks the rows if not done yet)."""
        if self._pending is not None:
            self._prepare()
        return self.step is not None

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The tapped rows' records (picked on first use)."""
        if self._pending is not None:
            self._prepare()
        return self._rows

    def begin(self, step: Step) -> None:
        """Start ``step``. The rows are picked later, when first needed (a gather, a
        kernel-level point, step end): at step start the device waits for the host, and
        with deferred checkpoints nothing needs them before step end."""
        self._clear()
        if not self._header:
            self._write_header(step)
        self.step = self._pending = step
        self.padded = step.padded_tokens or len(step.rows)
        for deferred in self._deferred.values():
            if deferred is not None:
                deferred.reset(step.mode, step.step)
        self._start_quick(step)
        if self.compiled is not None and self.live:
            self.compiled.begin(self.padded, torch.tensor(self.token_index, dtype=torch.int64))

    def wrapper_failed(self, exc: Exception) -> None:
        """A tap wrapper caught ``exc`` of its own (the engine's call went on): counted,
        the first one logged with its traceback."""
        self.failures += 1
        if self.failures == 1:
            logger.error("enginetap: a tap wrapper failed (the engine's call went on; later "
                         "failures are counted, not logged): %r", exc, exc_info=exc)

    def waiting(self, step: Step) -> None:
        """The engine waits for the device in ``step``: examine a quick step's
        checkpoints, and write the last step's record now rather than at this step's end
        (see :mod:`enginetap.core.sink`)."""
        if self.quick is not None and self.step is step:
            self.settle()
        self.sink.pump()

    def _prepare(self) -> None:
        """Pick the step's tapped rows; no rows: the step records nothing."""
        step, self._pending = self._pending, None
        assert step is not None
        prefixes = self.prefixes.update(step)
        picked = select_rows(step, self.filters, self.options.max_rows)
        if not picked:
            self.step = None
            return
        self._rows = rows = row_records(step, picked, prefixes)
        self.token_index = [r["token_index"] for r in rows]
        last = {r["key"]: i for i, r in enumerate(rows)}
        order = {key: n for n, key in enumerate(last)}
        self.request_of_row = [order[r["key"]] for r in rows]
        self.request_token_index = [self.token_index[i] for i in last.values()]
        for device, staging in self._staging.items():
            staging.reset(len(picked), self._device_list("inverse", device))

    def end(self, step: Step) -> None:
        quick = self.quick_step
        if self.quick is not None and self.step is step:
            self.settle()
        if self._pending is step:
            self._prepare()
        if self.step is not step:
            self._clear()
            return
        try:
            fill_late_lengths(self._rows, step)
            self.sink.submit(self._transfer(step), step.step)
            self._learn(step, quick)
            self.last_quick = quick
            self.last_checkpoints = len(self.names)
            self.last_deferred = sum(1 for slot in self.slots if slot < 0)
            self.last_bytes = sum(s.used for s in self._staging.values()) + sum(
                d.hashed_bytes for d in self._deferred.values() if d is not None)
        finally:
            self._clear()
