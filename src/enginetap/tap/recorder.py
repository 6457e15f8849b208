"""The per-step tap: stages checkpoint rows on device, writes one record per step.

Step begin picks the tapped rows; every checkpoint during the step gathers those rows'
bytes into the step's staging buffer (:mod:`enginetap.tap.fingerprint`), or, on a GPU,
keeps the tensor to hash in place at step end (:mod:`enginetap.tap.deferred`); step end
hashes them all and brings hashes and sampler values to the host in one transfer; the JSONL
record is formatted and written off the step path where a GPU runs the model
(:mod:`enginetap.core.sink`). Outside a step (warm-up, dummy runs) every checkpoint is
a no-op.
"""

from __future__ import annotations

import functools
import logging
import math
import operator
import platform
import re
from dataclasses import dataclass
from typing import Any

import torch

from enginetap.core.capability import ArmContext
from enginetap.core.context import Step, subscribe, unsubscribe
from enginetap.core.jsonl import NonFinite, RankJsonl
from enginetap.core.rowsplit import join_rows
from enginetap.core.sink import RecordSink
from enginetap.core.tensors import capturing
from enginetap.tap.deferred import DeferredHashes
from enginetap.tap.fingerprint import StepStaging, token_rows
from enginetap.tap.format import FORMAT, VERSION
from enginetap.tap.options import TapOptions
from enginetap.tap.rows import PrefixTracker, fill_late_lengths, row_records, select_rows
from enginetap.tap.vectors import VectorDump

logger = logging.getLogger("enginetap.tap")

__all__ = ["FORMAT", "QuickPlan", "TapRecorder", "outputs_of"]



class TapRecorder:
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
        """A compiled engine's checkpoints (:class:`~enginetap.tap.compiled.CompiledTap`),
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

    # -- lifecycle -------------------------------------------------------------------

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

    def _start_quick(self, step: Step) -> None:
        """Run ``step`` quick where it can be: every checkpoint deferrable is only listed
        by the sublayer wrappers (``quick``) and examined in one loop at the device wait or
        step end (:meth:`settle`), where the same Python costs several times less than
        between a forward's launches (BENCHMARKS.md, host cost per operation).

        A step is quick when its kind is settled (the last step of its kind verified
        nothing, so every name it met is verified), it is no full verification step, one
        device defers, no graph capture or compile tracing is on, and no patch splits
        forwards' rows across ranks (sp_prefill: whether a step is quick is decided per
        rank, and a row shard is joined by a collective at its call). Names gathered
        rather than deferred are in :attr:`at_call` and still examined at their call; a
        name a quick step cannot defer when examined (new, or of another layout) is left
        out of that step's record (listed under ``"dropped"``) and examined at its call,
        or verified, from the next step on."""
        if self._at_call_next:
            self.at_call.update(self._at_call_next)
            self._at_call_next.clear()
        deferred = self._only_deferred()
        if deferred is None or self.context.notes.get("rows_split"):
            return  # (split rows are joined by a collective: at their call on every rank)
        if len(deferred.demoted) != self._demotions:
            self.at_call.update(_call_key(n) for n in list(deferred.demoted)[self._demotions:])
            self._demotions = len(deferred.demoted)
        if (self.quick_steps and step.mode in self._settled and not deferred.full
                and not torch.compiler.is_compiling()
                and not (self._cuda and torch.cuda.is_current_stream_capturing())):
            self.quick = []
            self.quick_step = True
            self.quick_count += 1

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

    def _learn(self, step: Step, quick: bool) -> None:
        """After a step that was not quick: its kind is settled when it deferred
        checkpoints and verified none (every name it met had been verified)."""
        deferred = None if quick else self._only_deferred()
        if deferred is not None and deferred.names and not deferred.checks and not deferred.full:
            self._settled.add(step.mode)

    def _only_deferred(self) -> DeferredHashes | None:
        """The deferred state of the one device that defers (quick steps need exactly
        one); None otherwise."""
        return next(iter(self._fast.values())) if len(self._fast) == 1 else None

    # -- quick steps -------------------------------------------------------------------

    def settle(self) -> None:
        """Examine the checkpoints a quick step listed, in order (see
        :meth:`_start_quick`); later checkpoints of the step are examined at their call.
        Where the list matches the plan of the last quick step of its kind
        (:class:`QuickPlan`) it is kept whole; otherwise one by one, and a new plan made."""
        listed, self.quick = self.quick, None
        if not listed or self.step is None:
            return
        deferred = self._only_deferred()
        plan = self._plans.get(self.step.mode)
        if deferred is not None and plan is not None:
            if plan.keep(self, deferred, listed):
                self.planned_count += 1
                return
            del self._plans[self.step.mode]
        start, dropped, later = len(self.names), len(self.late_dropped), len(self._at_call_next)
        names, slots, late = self.names, self.slots, self._late
        for name, value in listed:
            if name is None:
                device, unique, slot = value
                names.append((device, unique))
                slots.append(slot)
            elif isinstance(value, torch.Tensor):
                late(name, value)
            elif isinstance(value, (tuple, list)):
                base = name[:-4]  # "<base>.out": a tuple's tensors are out, out1, ...
                for suffix, tensor in outputs_of(value):
                    late(f"{base}.{suffix}", tensor)
        if (deferred is not None and len(self.late_dropped) == dropped
                and len(self._at_call_next) == later):
            made = QuickPlan.make(self, deferred, listed, start)
            if made is not None:
                self._plans[self.step.mode] = made

    def _late(self, name: str, tensor: Any) -> None:
        """:meth:`checkpoint` for a checkpoint listed by a quick step, examined after the
        forward: deferred as it would have been at its call (a contiguous tensor as it
        is, another through its row view), else left out of this step (its bytes at the
        call are gone) and examined at its call from the next step."""
        if not isinstance(tensor, torch.Tensor):
            return
        deferred = self._fast.get(tensor.get_device())
        if deferred is None or tensor.requires_grad:  # the call would have gathered it
            if token_rows(tensor, self.padded) is not None:
                self._leave_out(self._unique(name), at_call=True)
            else:
                self._at_call_next.add(_call_key(name))
            return
        words = self._row_words(tensor) if tensor.is_contiguous() else 0
        source = None if words else token_rows(tensor, self.padded)
        if source is None and not words:  # no token rows (or a row shard): as at the call
            self._at_call_next.add(_call_key(name))
            return
        unique = self._unique(name)
        if not deferred.settled(unique):  # new to this kind of step: verify it first
            self._leave_out(unique, at_call=False)
            return
        if not tensor.is_inference() and tensor._version != deferred.seen_version.get(unique):
            deferred.demote_moved(unique)  # the same code path wrote it after its call
            self._leave_out(unique, at_call=True)
            return
        if words:
            slot = deferred.keep(unique, tensor, words, tensor.nbytes)
        else:
            assert source is not None
            slot = deferred.add(unique, source) if deferred.accepts(unique, source) else -1
        if slot < 0:  # demoted, or the byte budget is spent, or rows it cannot read
            self._leave_out(unique, at_call=True)
            return
        self.names.append((deferred.device, unique))
        self.slots.append(-1 - slot)

    def _leave_out(self, unique: str, at_call: bool) -> None:
        self.late_dropped.append(unique)
        if at_call:
            self._at_call_next.add(_call_key(unique))
        elif self.step is not None:
            self._settled.discard(self.step.mode)

    def _record(self, device: torch.device, unique: str, slot: int) -> None:
        """Add checkpoint ``unique`` (its staging or deferred ``slot``) to the step, in
        order: in a quick step, among the checkpoints listed for later."""
        if self.quick is not None:
            self.quick.append((None, (device, unique, slot)))
        else:
            self.names.append((device, unique))
            self.slots.append(slot)

    # -- checkpoints -----------------------------------------------------------------

    def index(self, device: torch.device) -> torch.Tensor:
        """The tapped rows' token indices on ``device`` (built once per step)."""
        return self._device_list("rows", device)

    def request_index(self, device: torch.device) -> torch.Tensor:
        """Token index of each tapped request's last tapped row (one per request)."""
        return self._device_list("requests", device)

    def _device_list(self, what: str, device: torch.device) -> torch.Tensor:
        if self._pending is not None:
            self._prepare()
        found = self._index.get((what, device))
        if found is None:
            values = {"rows": self.token_index, "requests": self.request_token_index,
                      "inverse": self.request_of_row}[what]
            found = torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)
            self._index[(what, device)] = found
        return found

    def allowed(self, name: str) -> bool:
        """False (and noted once) inside compile tracing or graph capture unless forced."""
        if self._forced or not (torch.compiler.is_compiling()
                                or (self._cuda and torch.cuda.is_current_stream_capturing())):
            return True
        if name not in self.refused:
            self.refused.add(name)
            logger.warning("tap: %s not recorded under torch.compile / CUDA-graph capture "
                           "(hooks would be traced into the graph; set options.tap.force)",
                           name)
        return False

    def checkpoint(self, name: str, tensor: Any) -> None:
        """Stage the tapped rows of ``tensor`` (a token-major tensor of the step's
        forward) under ``name``; tensors of another layout are skipped. Runs once per
        checkpoint, hundreds of times per step: the usual case (a contiguous tensor on a
        device whose checkpoints are deferred) is a few attribute reads and a kept
        reference, with no tensor object made; the rest takes :meth:`_checkpoint`."""
        if self.step is None or not isinstance(tensor, torch.Tensor) or not self.allowed(name):
            return  # allowed() first: under compile tracing nothing else may run here
        fast = self._fast
        deferred = fast.get(tensor.get_device()) if fast else None
        if deferred is None or tensor.requires_grad or not tensor.is_contiguous():
            self._checkpoint(name, tensor)
            return
        words = self._row_words(tensor)
        if not words:
            self._checkpoint(name, tensor)
            return
        unique = self._unique(name)
        slot = deferred.keep(unique, tensor, words, tensor.nbytes)
        if slot >= 0 and not deferred.needs_check(unique):
            self._record(deferred.device, unique, -1 - slot)
            return
        source = token_rows(tensor, self.padded)
        assert source is not None  # the row layout was checked above
        self._stage_named(unique, source, slot, deferred)

    def _row_words(self, tensor: torch.Tensor) -> int:
        """32-bit words per token row of a contiguous ``tensor`` whose leading dims are
        the step's token rows, at a 4-byte aligned address; 0 for any other layout."""
        shape, padded = tensor.shape, self.padded
        nbytes = tensor.nbytes
        if not (shape and (shape[0] == padded or (len(shape) > 1
                                                    and shape[0] * shape[1] == padded))
                and nbytes and not nbytes % (4 * padded) and not tensor.data_ptr() % 4):
            return 0
        return nbytes // padded // 4

    def _checkpoint(self, name: str, tensor: torch.Tensor) -> None:
        """:meth:`checkpoint` (past :meth:`allowed`) for what its fast path does not
        take (non-contiguous or grad-tracking tensors, row shards of a sequence-parallel
        forward): a view of the rows, deferred where the device allows, else gathered."""
        if tensor.requires_grad:  # only outside inference mode; a view costs little
            tensor = tensor.detach()
        source = token_rows(tensor, self.padded)
        if source is None:
            # A row shard of a sequence-parallel forward: fingerprint every rank's rows.
            joined = join_rows(tensor, self.padded)
            source = None if joined is None else token_rows(joined, self.padded)
        if source is None:
            return
        device = source.device
        unique = self._unique(name)
        check, deferred = -1, None
        if self._defer:
            deferred = self._deferred.get(device, False)
            if deferred is False:
                deferred = self._deferred_for(source)
            if deferred is not None and deferred.accepts(unique, source):
                check = deferred.add(unique, source)
                if not deferred.needs_check(unique):
                    self._record(device, unique, -1 - check)
                    return
        self._stage_named(unique, source, check, deferred)

    def _stage_named(self, unique: str, source: torch.Tensor, check: int,
                     deferred: DeferredHashes | None) -> None:
        """Gather ``source``'s tapped rows under ``unique``; with ``check`` >= 0 the same
        checkpoint is also deferred (slot ``check``) and the two hashes are compared."""
        if self._pending is not None:
            self._prepare()
            if self.step is None:
                return
        slot = self._stage(source)
        if check >= 0 and deferred is not None:
            deferred.checks.append((unique, slot, check))
        elif self._fast:  # gathered, not deferred: examined at its call in quick steps
            self._at_call_next.add(_call_key(unique))
        self._record(source.device, unique, slot)

    def _stage(self, source: torch.Tensor) -> int:
        """Gather the tapped rows of ``source`` into a staging slot; the slot's place in
        its device's staging order."""
        device = source.device
        staging = self._staging.get(device) or self._staging_for(device)
        index = self._index.get(("rows", device))
        staging.stage(source, self.index(device) if index is None else index)
        return len(staging.order) - 1

    def _deferred_for(self, source: torch.Tensor) -> DeferredHashes | None:
        from enginetap.tap import kernels

        found = None
        if kernels.available(source):
            found = DeferredHashes(source.device, self.options.defer_bytes,
                                   verify_every=self.options.defer_verify_every,
                                   lag=int(source.device.type == "cuda"
                                           and self.vectors is None))
            if self.step is not None:
                found.reset(self.step.mode, self.step.step)
        self._deferred[source.device] = found
        if found is not None:
            self._fast[source.get_device()] = found
        return found

    def checkpoint_rows(self, name: str, rows: torch.Tensor) -> None:
        """Stage ``rows`` (one per tapped row, already gathered) under ``name``."""
        if not self.live or not self.allowed(name):
            return
        source = rows.detach().reshape(len(self.rows), -1)
        if source.dtype == torch.bool:
            source = source.view(torch.uint8)
        staging = self._staging_for(source.device)
        staging.stage(source, None)
        self._record(source.device, self._unique(name), len(staging.order) - 1)

    def checkpoint_requests(self, name: str, rows: torch.Tensor) -> None:
        """Stage ``rows`` (one per tapped request, in :meth:`request_index` order) under
        ``name``; every tapped row of a request gets its request's hash."""
        if not self.live or not self.allowed(name):
            return
        source = rows.detach().reshape(len(self.request_token_index), -1)
        if source.dtype == torch.bool:
            source = source.view(torch.uint8)
        staging = self._staging_for(source.device)
        staging.stage_per_request(source)
        self._record(source.device, self._unique(name), len(staging.order) - 1)

    def note_logits(self, logits: torch.Tensor) -> None:
        """Top-2 logits of each tapped row (``logits`` is ``[tapped rows, vocab]``)."""
        if not self.options.sampler or not self.live or not self.allowed("sampler"):
            return
        values, ids = torch.topk(logits.detach().float(), 2, dim=-1)
        packed = torch.cat([ids.to(torch.int64), values.double().view(torch.int64)], dim=1)
        self.sampler.append((packed.device, packed))

    def _unique(self, name: str) -> str:
        """``name``, or ``name#2``, ``name#3``... for a module run again in one step."""
        seen = self.counts.get(name, 0) + 1
        self.counts[name] = seen
        return name if seen == 1 else f"{name}#{seen}"

    def _staging_for(self, device: torch.device) -> StepStaging:
        staging = self._staging.get(device)
        if staging is None:
            staging = self._staging[device] = StepStaging(len(self.rows), device)
            staging.reset(len(self.rows), self._device_list("inverse", device))
        return staging

    # -- records ---------------------------------------------------------------------

    def _transfer(self, step: Step) -> Any:
        """Hash what was staged and bring it to the host (one transfer per device, one
        device in practice); returns the function that formats the record from it."""
        by_device: dict[torch.device, list[tuple[str, int]]] = {}
        for (device, name), slot in zip(self.names, self.slots):
            by_device.setdefault(device, []).append((name, slot))
        host: list[tuple[list[str], torch.Tensor, int]] = []
        dropped: list[str] = []
        k = len(self.rows)
        launched = []
        for device, entries in by_device.items():
            hashes, names, checks = self._device_hashes(device, entries, dropped)
            extra = [p.flatten() for d, p in self.sampler if d == device]
            launched.append((device, names, checks,
                             torch.cat([hashes.flatten(), checks, *extra]), extra))
        gone = set(dropped)
        order = [name for _, name in self.names if name not in gone]
        if self.compiled is not None:  # hashed in the graph: one read of its buffer
            names, hashes = self.compiled.collect(k)
            order = names + order
            host.append((names, hashes.flatten(), 0))
        head = {"kind": "step", "mode": step.mode, "engine": step.engine, "rows": self.rows,
                "checkpoints": order, "sampled": dict(step.sampled)}
        dropped += self.late_dropped
        if dropped:
            head["dropped"] = dropped
        if (self.vectors is None and launched and self.compiled is None
                and all(d.type == "cuda" for d, *_ in launched)
                and all(d in by_device for d, _ in self.sampler)):
            return self._transfer_later(launched, head, k)
        self._apply_flags()
        # The previous step's record is written now, while the device finishes this step.
        self.sink.pump()
        for device, names, checks, on_device, extra in launched:
            flat = on_device.cpu()
            if checks.numel():
                deferred = self._deferred[device]
                assert deferred is not None
                deferred.compare_flags(flat[len(names) * k:len(names) * k + checks.numel()])
                flat = torch.cat([flat[:len(names) * k], flat[len(names) * k + checks.numel():]])
            host.append((names, flat, len(extra)))
            if self.vectors is not None:
                self.vectors.maybe_dump(step.step, self.rows, names, self._staging[device],
                                        flat[:len(names) * k])
        host += [([], p.flatten().cpu(), 1) for d, p in self.sampler if d not in by_device]
        return lambda: _format(head, host, k)

    def _transfer_later(self, launched: list[tuple[torch.device, list[str], torch.Tensor,
                                                   torch.Tensor, list[torch.Tensor]]],
                        head: dict[str, Any], k: int) -> Any:
        """On a GPU: queue the step's hashes into pinned host memory without waiting for
        them. The engine has already synchronized for its sampled tokens, so the device
        would otherwise sit idle through the hash kernel, the transfer and the wait while
        the host plans the next step; this way they overlap it. The record is formatted
        when it is written (the next step's end, or the sink's idle writer), after the
        copy's event; the verification flags are read by the engine's thread at the next
        step's end (or when the tap is removed)."""
        copies = []
        for device, names, checks, on_device, extra in launched:
            host = torch.empty(on_device.shape, dtype=on_device.dtype, pin_memory=True)
            host.copy_(on_device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            copies.append((event, device, names, checks.numel(), host, len(extra)))
        self._apply_flags()  # the previous step's: landed long ago
        self._flags = [(event, host[len(names) * k:len(names) * k + n],
                        self._deferred[device], self._checked(device))
                       for event, device, names, n, host, _ in copies if n]
        self.sink.pump()  # the previous step's record, while the device works on this one

        def make() -> dict[str, Any]:
            host_list = []
            for event, _, names, n, host, extras in copies:
                event.synchronize()
                flat = host
                if n:
                    flat = torch.cat([host[:len(names) * k], host[len(names) * k + n:]])
                host_list.append((names, flat, extras))
            return _format(head, host_list, k)

        return make

    def _apply_flags(self) -> None:
        """Demote the deferred checkpoints whose verification failed in the step whose
        hashes were queued last (its flags read once its copy landed)."""
        flags, self._flags = self._flags, []
        for event, equal, deferred, names in flags:
            event.synchronize()
            if deferred is not None:
                deferred.compare_flags(equal, names)

    def _checked(self, device: torch.device) -> list[str]:
        """The names this step verified on ``device``, in the order of its flags."""
        deferred = self._deferred.get(device)
        return [] if deferred is None else [name for name, _, _ in deferred.checks]

    def _device_hashes(self, device: torch.device, entries: list[tuple[str, int]],
                       dropped: list[str]) -> tuple[torch.Tensor, list[str], torch.Tensor]:
        """One device's ``[checkpoints, rows]`` hashes in checkpoint order (staged and
        deferred merged; deferred tensors modified since their checkpoint left out and
        named in ``dropped``), the names kept, and the verification flags (int64, 1 where
        a verified checkpoint's deferred hash equals its staged one)."""
        staging = self._staging.get(device)
        staged = staging.hashes() if staging is not None else \
            torch.zeros((0, len(self.rows)), dtype=torch.int64, device=device)
        deferred = self._deferred.get(device)
        no_checks = torch.zeros(0, dtype=torch.int64, device=device)
        if deferred is None or not deferred.names:
            return staged, [name for name, _ in entries], no_checks
        moved = set(deferred.moved())
        later = deferred.hashes(self.index(device))
        order, names = [], []
        for name, slot in entries:
            if slot < 0 and -1 - slot in moved:
                dropped.append(name)
                continue
            order.append(slot if slot >= 0 else staged.shape[0] - 1 - slot)
            names.append(name)
        if not staged.shape[0] and len(order) == later.shape[0]:
            merged = later  # all deferred, none dropped: already in checkpoint order
        else:
            merged = torch.cat([staged, later]).index_select(
                0, torch.tensor(order, dtype=torch.int64).to(device, non_blocking=True))
        checks = no_checks
        if deferred.checks:
            pairs = torch.tensor([(s, d) for _, s, d in deferred.checks], dtype=torch.int64)
            pairs = pairs.to(device, non_blocking=True)
            checks = (staged.index_select(0, pairs[:, 0]) == later.index_select(0, pairs[:, 1])
                      ).all(dim=1).to(torch.int64)
        return merged, names, checks

    def _write_header(self, step: Step) -> None:
        self._header = True
        hooks = self.context.hooks
        header = {
            "kind": "header", "format": FORMAT, "version": VERSION,
            "engine": step.engine, "engine_version": hooks.engine_version(),
            "world_size": self.context.world_size, "tp_size": self.context.world_size,
            "kv_block_size": step.kv_block_size, "models": self.models,
            "cache_groups": step.extra.get("cache_groups"),
            "options": self.options.model_dump(),
            "compiled": step.extra.get("compiled") or torch.compiler.is_compiling(),
            "cuda_graphs": capturing(), "eager": not capturing(),
            "torch": torch.__version__, "host": platform.node(),
        }
        if self.compiled is not None:
            header["compiled"] = getattr(self.compiled, "mode", "torch.compile")
            header["not_placed"] = self.compiled.not_placed
        self.sink.submit(lambda: header, -1)
        if step.extra.get("compiled") and self.compiled is None:
            logger.warning("tap: the engine compiles the model (%s): checkpoints of modules "
                           "inside the compiled forward are not recorded (torch.compile "
                           "inlines past their hooks); kernel-level points in custom ops and "
                           "the sampler are. Run the engine eager (vLLM: enforce_eager=True) "
                           "to tap every sublayer", step.extra["compiled"])


@dataclass(slots=True)
class QuickPlan:
    """How a quick step's list was kept when every checkpoint in it was kept as it is
    (contiguous inference tensors of token rows, one deferred slot each), so that the
    next quick step of its kind that lists the same is kept in one call. The same means:
    the same names in the same order (checkpoints examined at their call in the same
    places), tensors of the same shapes on the deferring device (the hash reads bytes:
    their dtype does not matter), contiguous, made in inference mode (no version counter
    to compare), at 4-byte aligned addresses, within the byte budget, the same number of
    token rows, no name demoted since. Each of those is one C-level pass over the list,
    where examining the checkpoints one by one costs a dozen Python operations each
    (BENCHMARKS.md: the settle loop). A list that differs in anything is examined one by
    one, as without a plan, and planned anew."""

    listed: list[str | None]
    """The list's names in order (None where a checkpoint taken at its call sits)."""
    shapes: list[torch.Size]
    uniques: list[str]
    """Each kept tensor's checkpoint name (with its repeat count)."""
    words: list[int]
    """Each kept tensor's 32-bit words per token row."""
    nbytes: int
    padded: int
    demotions: int
    first: int
    """The deferred slot of the first kept tensor."""
    device_index: int
    counts: dict[str, int]
    """Calls per checkpoint name in the list (the recorder's repeat counts)."""
    order: list[tuple[torch.device, str] | None]
    slots: list[int | None]
    """What the recorder's names and slots get, None where a checkpoint taken at its call
    sits (filled from the list's marker)."""
    markers: list[tuple[int, int]]
    """(place in the list, place in ``order``) of each checkpoint taken at its call."""

    @classmethod
    def make(cls, recorder: TapRecorder, deferred: DeferredHashes,
             listed: list[tuple[str | None, Any]], start: int) -> QuickPlan | None:
        """The plan of ``listed``, just examined one by one into the recorder's names and
        slots from ``start`` on with nothing left out; None where any checkpoint in it was
        kept otherwise than as it is (a row view, a version counter to compare, staged)."""
        names, slots = recorder.names[start:], recorder.slots[start:]
        flat: list[torch.Tensor] = []
        uniques: list[str] = []
        words: list[int] = []
        kept: list[int] = []
        counts: dict[str, int] = {}
        markers: list[tuple[int, int]] = []
        j = 0
        for i, (name, value) in enumerate(listed):
            if name is None:
                if j >= len(names) or names[j] != value[:2]:
                    return None
                markers.append((i, j))
                j += 1
                continue
            if isinstance(value, torch.Tensor):
                called = [(name, value)]
            elif isinstance(value, (tuple, list)):
                called = [(f"{name[:-4]}.{suffix}", t) for suffix, t in outputs_of(value)]
            else:
                continue
            for call, tensor in called:
                row_words = recorder._row_words(tensor)
                if j >= len(names) or slots[j] >= 0 or not tensor.is_contiguous() \
                        or not tensor.is_inference() or tensor.requires_grad or not row_words:
                    return None
                counts[call] = counts.get(call, 0) + 1
                uniques.append(names[j][1])
                words.append(row_words)
                kept.append(slots[j])
                flat.append(tensor)
                j += 1
        if j != len(names) or not flat:
            return None
        first = -1 - kept[0]
        if kept != list(range(-1 - first, -1 - first - len(kept), -1)) \
                or len(deferred.tensors) != first + len(kept):
            return None
        index = flat[0].get_device()
        if any(t.get_device() != index for t in flat) or recorder._fast.get(index) is not deferred:
            return None
        order: list[tuple[torch.device, str] | None] = list(names)
        planned_slots: list[int | None] = list(slots)
        for _, position in markers:
            order[position] = planned_slots[position] = None
        return cls(listed=[name for name, _ in listed], shapes=[t.shape for t in flat],
                   uniques=uniques, words=words,
                   nbytes=sum(t.nbytes for t in flat), padded=recorder.padded,
                   demotions=len(deferred.demoted), first=first, device_index=index,
                   counts=counts, order=order, slots=planned_slots, markers=markers)

    def keep(self, recorder: TapRecorder, deferred: DeferredHashes,
             listed: list[tuple[str | None, Any]]) -> bool:
        """Keep ``listed`` whole as planned, into ``deferred`` and the recorder's names
        and slots; False (nothing kept) where it differs from the plan."""
        if (len(listed) != len(self.listed) or recorder.padded != self.padded
                or len(deferred.demoted) != self.demotions
                or len(deferred.tensors) != self.first
                or [name for name, _ in listed] != self.listed):
            return False
        flat: list[torch.Tensor] = []
        add = flat.append
        for name, value in listed:
            if isinstance(value, torch.Tensor):
                add(value)
            elif name is not None and isinstance(value, (tuple, list)):  # outputs_of's
                flat += [v for v in value if isinstance(v, torch.Tensor)]  # tensors, unnamed
        if (len(flat) != len(self.uniques) or list(map(_SHAPE, flat)) != self.shapes
                or not all(map(torch.Tensor.is_contiguous, flat))
                or not all(map(torch.Tensor.is_inference, flat)) or any(map(_GRAD, flat))
                or list(map(torch.Tensor.get_device, flat)).count(self.device_index)
                != len(flat)):
            return False
        addresses = list(map(torch.Tensor.data_ptr, flat))
        if functools.reduce(operator.or_, addresses, 0) & 3 \
                or deferred.held + self.nbytes > deferred.budget:
            return False
        deferred.keep_listed(self.uniques, flat, addresses, self.words, self.nbytes)
        recorder.counts.update(self.counts)
        order, slots = self.order, self.slots
        if self.markers:
            order, slots = order.copy(), slots.copy()
            for i, j in self.markers:
                device, unique, slot = listed[i][1]
                order[j], slots[j] = (device, unique), slot
        recorder.names += order  # type: ignore[arg-type]
        recorder.slots += slots  # type: ignore[arg-type]
        return True


_SHAPE = operator.attrgetter("shape")
_GRAD = operator.attrgetter("requires_grad")


_REPEAT = re.compile(r"#\d+$")
_OUTPUT = re.compile(r"\.out\d+$")


def _call_key(name: str) -> str:
    """The name a sublayer wrapper tests against :attr:`TapRecorder.at_call` for
    checkpoint ``name``: without a repeat count (``#2``), and a tuple output's tensors
    (``.out1``, ``.out2``...) under the tuple's ``.out``."""
    return _OUTPUT.sub(".out", _REPEAT.sub("", name))


def outputs_of(value: Any) -> list[tuple[str, Any]]:
    """``out`` for a tensor; ``out``, ``out1``, ... for the tensors of a tuple (a router's
    logits, weights and expert ids)."""
    if isinstance(value, (tuple, list)):
        return [("out" if i == 0 else f"out{i}", v) for i, v in enumerate(value)
                if isinstance(v, torch.Tensor)]
    return [("out", value)]


def _format(head: dict[str, Any], host: list[tuple[list[str], torch.Tensor, int]],
            k: int) -> dict[str, Any]:
    hashes: dict[str, str] = {}
    sampler: list[list[int]] = []
    width = 16 * k
    for names, flat, extra in host:
        digits = flat[:len(names) * k].numpy().astype(">u8").tobytes().hex()
        for j, name in enumerate(names):
            hashes[name] = digits[j * width:(j + 1) * width]
        if extra:
            tail = flat[len(names) * k:].tolist()
            sampler = [tail[r * 4:r * 4 + 4] for r in range(k)]
    rows = [_sampler_row(s) for s in sampler]
    record = {**head, "hashes": [hashes[n] for n in head["checkpoints"]], "sampler": rows}
    # The sampler's logits are the record's only floats; a masked vocabulary (constrained
    # decoding) makes them infinite, which only json writes as they are.
    if all(math.isfinite(r["top1"]) and math.isfinite(r["top2"]) for r in rows):
        return record
    return NonFinite(record)


def _sampler_row(packed: list[int]) -> dict[str, Any]:
    import struct

    top1, top2 = (struct.unpack("<d", struct.pack("<q", v))[0] for v in packed[2:4])
    return {"argmax": packed[0], "runner_up": packed[1], "top1": top1, "top2": top2,
            "gap": top1 - top2}
