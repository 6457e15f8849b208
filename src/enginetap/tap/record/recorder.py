"""The per-step tap: the recorder's lifecycle, one record per step.

Each step's recording accumulates in its own slotted ledger (:mod:`.ledger`), made at
the step's begin. Every checkpoint during the step gathers the tapped rows' bytes into
the step's staging buffer (:mod:`.checkpointer`, :mod:`.staging`), or, on a GPU, keeps
the tensor to hash in place at step end (:mod:`.deferred`; settled steps run quick,
:mod:`.quick`); step end hashes them all and brings hashes and sampler values to the host
in one transfer (:mod:`.transfer`); the JSONL record is formatted and written off the
step path where a GPU runs the model (:mod:`enginetap.core.sink`). Outside a step
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
from enginetap.tap.record.calls import RecorderCalls
from enginetap.tap.record.checkpointer import Checkpointer
from enginetap.tap.record.ledger import StepLedger
from enginetap.tap.record.quick import QuickSteps
from enginetap.tap.record.transfer import Transfer, header
from enginetap.tap.record.rows import PrefixTracker, fill_late_lengths, row_records, select_rows
from enginetap.tap.record.vectors import VectorDump

logger = logging.getLogger("enginetap.tap")

__all__ = ["TapRecorder"]


class TapRecorder(RecorderCalls):
    """One per armed process; subscribed to the step context while installed. The step
    under way is :attr:`step` and its :attr:`ledger`; the :attr:`checkpointer` routes
    checkpoints, :attr:`quick_state` runs settled steps quick, :attr:`transfer` ends them."""

    def __init__(self, context: ArmContext, options: TapOptions) -> None:
        self.context = context
        self.options = options
        self.writer = RankJsonl(context.out_dir / f"{options.file}.jsonl", context.rank,
                                fast=True, offload=True)  # see transfer._format
        self.sink = RecordSink(self.writer, deferred=torch.cuda.is_available(),
                               name="enginetap-tap-sink")
        self.vectors = VectorDump.from_options(context.out_dir, context.rank, options)
        self.filters = [options.request_filter, context.config.request_filter]
        self.prefixes = PrefixTracker()
        self.models: list[dict[str, Any]] = []
        self.failures = 0
        """Errors the tap's own wrappers caught (each call went on; the first is logged)."""
        self._header = False
        self.checkpointer = Checkpointer(options, pick=self._prepare)
        self._take = self.checkpointer.take  # bound once: the per-checkpoint call
        self.quick_state = QuickSteps()
        self.at_call = self.quick_state.at_call
        """Checkpoint names examined at their call even in a quick step (the wrappers'
        test per call; see :class:`~.quick.QuickSteps`)."""
        self.transfer = Transfer(self.sink, self.vectors)
        self.quick_steps = True
        """Run settled steps quick (see :meth:`~.quick.QuickSteps.start`); False: every
        checkpoint is examined as it comes (benchmarks compare the two)."""
        self.quick_count = self.planned_count = 0
        """Steps run quick since install, and those whose list its plan kept whole."""
        self.last_checkpoints = self.last_bytes = self.last_deferred = 0
        """Of the last step: checkpoints recorded, bytes staged and hashed, checkpoints
        hashed in place at step end (benchmarks, logs)."""
        self.last_quick = False
        self.compiled: Any = None
        """A compiled engine's checkpoints (:class:`~enginetap.tap.record.compiled.CompiledTap`),
        hashed in the graph and collected at step end."""
        self.ledger = StepLedger()
        self._picked: tuple[Step | None, list[int]] = (None, [])
        """The last step whose rows :meth:`_pick` chose, and its rows."""
        self.carried: StepLedger | None = None
        """The row lists of the last step whose rows were picked, with their device
        tensors (a step with the same lists keeps them, :meth:`.StepLedger.pick`)."""
        self._clear()

    def _clear(self) -> None:
        """No step under way; the step's ledger retired."""
        self.quick_state.later |= self.ledger.call_later
        if self.ledger.index:
            self.carried = self.ledger.carried()
        self.ledger = StepLedger()
        self.step: Step | None = None
        """The step under way, if it taps any row (the wrappers read it per call)."""
        self.quick: list[tuple[str | None, Any]] | None = None
        """The ledger's :attr:`~.ledger.StepLedger.listed`, for the wrappers to append to."""

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
        self.transfer.apply_flags()
        self.sink.close()

    def model_loaded(self, model: Any) -> None:
        config = getattr(model, "config", None)
        dtype = next((str(p.dtype) for p in model.parameters()), None)
        self.models.append({"class": type(model).__name__, "dtype": dtype,
                            "model_type": getattr(config, "model_type", None),
                            "layers": getattr(config, "num_hidden_layers", None)})
        self.quick_state.forget()

    def begin(self, step: Step) -> None:
        """Start ``step``. The rows are picked later, when first needed (a gather, a
        kernel-level point, step end): at step start the device waits for the host, and
        with deferred checkpoints nothing needs them before step end."""
        self._clear()
        if not self._header:
            self._header = True
            record = header(self.context, self.options, self.models, self.compiled, step)
            self.sink.submit(lambda: record, -1)
        self.step = step
        ledger = self.ledger
        ledger.pending, ledger.mode = step, step.mode
        ledger.padded = step.padded_tokens or len(step.rows)
        self.checkpointer.start(step.mode, step.step)
        if self.quick_state.start(step.mode, self.checkpointer.fast, self.quick_steps,
                                  split=bool(self.context.notes.get("rows_split"))):
            self.quick = ledger.listed = []
            ledger.quick = True
            self.quick_count += 1
        if self.compiled is not None:
            # Only the tapped rows' token indices are needed before the forward (the
            # compiled or captured graph reads them); their records are made when first
            # needed, on CUDA behind the replay (the LM head's hook, the device wait).
            picked = self._pick(step)
            if not picked:
                self._prepare()  # no row: the step records nothing
            else:
                tokens = step.rows.token_index
                self.compiled.begin(ledger.padded, picked if tokens is None
                                    else [tokens[i] for i in picked])

    def wrapper_failed(self, exc: Exception) -> None:
        """A tap wrapper caught ``exc`` of its own (the engine's call went on): counted,
        the first one logged with its traceback."""
        self.failures += 1
        if self.failures == 1:
            logger.error("enginetap: a tap wrapper failed (the engine's call went on; later "
                         "failures are counted, not logged): %r", exc, exc_info=exc)

    def waiting(self, step: Step) -> None:
        """The engine waits for the device in ``step``: examine a quick step's
        checkpoints, queue a compiled tap's buffer to the host behind the step's work
        (:meth:`.CompiledTap.queue`), and write the last step's record now rather than at
        this step's end (see :mod:`enginetap.core.sink`)."""
        if self.quick is not None and self.step is step:
            self.settle()
        if self.ledger.pending is step:  # (a compiled step's rows, picked in begin)
            self._prepare()
        compiled = self.compiled
        if compiled is not None and self.step is step and hasattr(compiled, "queue") \
                and compiled.buffer.is_cuda \
                and self.vectors is None and compiled.queued is None \
                and all(d == compiled.buffer.device for d, _ in self.ledger.sampler):
            compiled.queue([p.flatten() for _, p in self.ledger.sampler])
        self.sink.pump()

    def settle(self) -> None:
        """Examine the checkpoints a quick step listed (see :meth:`.QuickSteps.settle`);
        later checkpoints of the step are examined at their call."""
        listed, self.quick = self.quick, None
        self.ledger.listed = None
        if listed and self.step is not None and self.quick_state.settle(
                self.ledger, listed, self.checkpointer.fast):
            self.planned_count += 1

    def _prepare(self) -> None:
        """Pick the step's tapped rows; no rows: the step records nothing."""
        ledger = self.ledger
        step, ledger.pending = ledger.pending, None
        assert step is not None
        prefixes = self.prefixes.update(step)
        picked = self._pick(step)
        if not picked:
            self.step = None
            return
        ledger.pick(row_records(step, picked, prefixes), self.carried)
        self.checkpointer.rows_picked(ledger)

    def _pick(self, step: Step) -> list[int]:
        """The rows of ``step`` to tap (:func:`.select_rows`), chosen once per step."""
        if self._picked[0] is not step:
            self._picked = (step, select_rows(step, self.filters, self.options.max_rows))
        return self._picked[1]

    def end(self, step: Step) -> None:
        ledger = self.ledger
        quick = ledger.quick
        if self.quick is not None and self.step is step:
            self.settle()
        if ledger.pending is step:
            self._prepare()
        if self.step is not step:
            self._clear()
            return
        try:
            fill_late_lengths(ledger.rows, step)
            self.sink.submit(self.transfer.step_end(step, ledger, self.checkpointer,
                                                    self.compiled), step.step)
            self.quick_state.learn(step.mode, quick, self.checkpointer.fast)
            self.last_quick = quick
            self.last_checkpoints = len(ledger.names)
            self.last_deferred = ledger.deferred_count
            self.last_bytes = self.checkpointer.hashed_bytes()
        finally:
            self._clear()

    def take(self, name: str, tensor: Any) -> None:
        """Record the tapped rows of ``tensor`` (a token-major tensor of the step's
        forward) under checkpoint ``name`` (see :meth:`.Checkpointer.take`)."""
        if self.step is not None:
            self._take(self.ledger, name, tensor)
