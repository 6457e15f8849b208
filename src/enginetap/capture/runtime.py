"""The capture runtime of one armed process: probes installed, calls selected, copied out.

For each probe (from the engine's table, :meth:`EngineHooks.capture_probes`) a wrapper is
installed through the patching layer once a model is loaded (class-suffix targets are
resolved against that model). The wrappers, and the module scope's, run only on selected
steps: outside them their gate is shut and wrapt calls the engine's function directly
(a few hundred nanoseconds per call, no Python frame). On every call the wrapper asks, in
this order and cheaply: is a step published and selected, does the probe fire in this
mode and sublayer, is the probe still healthy. Only then does it bind the call,
instantiate the definition, claim a workload slot for the variant, snapshot in-place
state, run the engine's call, adapt and copy the tensors out, and hand them to the writer.

A probe that fails (engine changed, adapter bug, a workload the definition refuses) is
disabled: logged once with what/why/fix, counted in the summary; the engine's call always
runs exactly as it would unarmed and its result is returned untouched.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from enginetap.capture.procwriter import ProcessWriter, groups_for
from enginetap.capture.labels import RequestLabels
from enginetap.capture.options import CaptureOptions
from enginetap.capture.probe import Probe, ProbeCall
from enginetap.capture.provenance import PendingReceipt, Provenance, model_identity
from enginetap.capture.selection import Selector
from enginetap.capture.writer import Item, Writer
from enginetap.core import context
from enginetap.core.capability import ArmContext
from enginetap.core.context import current_step
from enginetap.core.patching import Gate, PatchSet, bind_arguments
from enginetap.core.scope import (ScopeUse, SublayerSpec, current_module, current_names,
                                  sublayer_classes)
from enginetap.dataset import Dataset
from enginetap.dataset.schema import Definition

logger = logging.getLogger("enginetap.capture")

__all__ = ["CaptureRuntime", "SUMMARY_FILE"]

SUMMARY_FILE = "capture-summary-rank{rank}.json"


EXIT_GRACE_S = 20.0
"""How long a shutdown after SIGTERM/SIGINT may take before the capture ends it."""


class CaptureRuntime:
    """See the module docstring; installed by the ``capture`` capability."""

    def __init__(self, context_: ArmContext, options: CaptureOptions) -> None:
        self.context = context_
        self.options = options
        hooks = context_.hooks
        self.probes = [p for p in hooks.capture_probes() if self._wanted_family(p.family)]
        self.labels = RequestLabels(options.labels_file
                                    or context_.out_dir / "capture-labels.json")
        self.selector = Selector(options.selection(), self.labels)
        self.provenance = Provenance(hooks.engine, hooks.engine_version(), context_.rank,
                                     context_.world_size)
        self.dataset_root = Path(options.dataset or context_.out_dir / "dataset")
        self.writer: Writer | ProcessWriter | None = None
        if context_.rank != 0:
            # Every rank takes part in the probes' gathers, so a directory that disarms
            # rank 0 (below) must disarm the others too, or they would gather alone. The
            # ranks share a file system; creating the root is what rank 0 does first.
            self.dataset_root.mkdir(parents=True, exist_ok=True)
        if context_.rank == 0:  # rank 0 writes the logical op, rebuilt from every rank
            dataset = Dataset(self.dataset_root, create=True)
            if options.writer == "process":
                try:
                    self.writer = ProcessWriter(dataset.root, budget_bytes=options.budget_bytes,
                                                when_full=options.when_full,
                                                batch=options.batch)
                except OSError as exc:  # no memfd, no room to map the ring, cannot spawn
                    logger.warning("enginetap capture: cannot start the writer process (%s); "
                                   "writing from a thread of this process instead. Fix: "
                                   "lower options.capture.budget_bytes or free memory", exc)
            if self.writer is None:
                self.writer = Writer(dataset, budget_bytes=options.budget_bytes,
                                     when_full=options.when_full, batch=options.batch,
                                     switch_interval_s=options.switch_interval_s)
        self.patches = PatchSet("capture")
        self.gate = Gate(is_open=False, detach=True)
        """Open during selected steps only (set only through :meth:`_select`)."""
        scope = context_.notes.get("scope")
        self.scope: ScopeUse | None = scope if isinstance(scope, ScopeUse) else None
        self.installed_targets: set[str] = set()
        self._installed: set[tuple[str, str]] = set()
        self.failures: Counter = Counter()
        self.disabled: dict[str, str] = {}
        self.skipped: Counter = Counter()
        self._definitions: dict[tuple, Definition | None] = {}
        self._closed = False
        self._previous_handlers: dict[int, Any] = {}
        self._watchdog: threading.Thread | None = None

    # ---------------------------------------------------------------- lifecycle
    def install(self) -> CaptureRuntime:
        if self.scope is not None:
            self.scope.part_time("capture")
        context.subscribe(on_begin=self._on_begin, on_end=self._on_end)
        self.context.hooks.on_model_loaded(self.add_model)
        atexit.register(self.close)
        self._install_signal_handlers()
        return self

    def uninstall(self) -> None:
        self.patches.uninstall()
        context.unsubscribe(self._on_begin)
        context.unsubscribe(self._on_end)
        self._select(False)
        self.close()
        atexit.unregister(self.close)
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()

    def _on_begin(self, step: Any) -> None:
        self.selector.on_begin(step)
        selected = self.selector.selected_step is not None
        if selected:
            step.select("capture")
        if selected or self.gate.is_open:  # open, or still open after an abandoned step
            self._select(selected)

    def _on_end(self, step: Any) -> None:
        if self.gate.is_open:
            self._select(False)
        self.selector.on_end(step)

    def _select(self, selected: bool) -> None:
        """Open the probes' gate (and ask for the module scope) for a selected step."""
        self.gate.set(selected)
        if self.scope is not None:
            self.scope.need("capture", selected)

    def add_model(self, model: Any) -> None:
        """Install every probe for ``model`` (its class-suffix targets resolved)."""
        self.provenance.model = model_identity(model)
        new = []
        for probe in self.probes:
            for target in self._targets(probe, model):
                # Keyed by probe too: two probes may share a target (one kernel, prefill
                # and decode families); each gets its own wrapper.
                if (probe.name, target) not in self._installed:
                    self._installed.add((probe.name, target))
                    self.installed_targets.add(target)
                    new.append((target, self._wrapper(probe)))
        self.patches.install_more(new, self.gate)

    def _targets(self, probe: Probe, model: Any) -> list[str]:
        if probe.target:
            return [probe.target]
        classes = sublayer_classes(model, SublayerSpec(suffixes=(probe.suffix,)))
        return [f"{c.__module__}:{c.__qualname__}.{probe.method}" for c in classes]

    def close(self) -> dict[str, Any]:
        """Flush the writer and write the summary (idempotent); returns the summary."""
        if not self._closed:
            self._closed = True
            if self.writer is not None:
                self.writer.close()
            self._write_summary()
        return self.summary()

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(signum)
            self._previous_handlers[signum] = previous
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        """Turn SIGTERM/SIGINT into an orderly exit: the stack unwinds (every lock the
        engine thread held is released) and the exit handler flushes the writer.
        Flushing here, in the middle of whatever the engine thread was doing, could
        deadlock on a lock it holds."""
        previous = self._previous_handlers.get(signum)
        if previous == signal.SIG_IGN:  # the process ignores it (a background job's SIGINT)
            return
        self._start_exit_watchdog(signum)
        if callable(previous):
            previous(signum, frame)  # SIGINT's default raises KeyboardInterrupt
        else:
            raise SystemExit(128 + signum)

    def _start_exit_watchdog(self, signum: int) -> None:
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._exit_watchdog, args=(signum,),
                                              name="enginetap-capture-exit", daemon=True)
            self._watchdog.start()

    def _exit_watchdog(self, signum: int) -> None:
        """After a signal, once the interpreter is shutting down (the main thread has
        finished), give the exit ``EXIT_GRACE_S``; if the process is still there, the
        shutdown is stuck (an exception raised by the signal inside a lock's critical
        section can leave it held): flush the writer, which shares no lock with the
        engine thread, write the summary and end the process. A program that caught the
        interrupt and went on is never touched: its main thread stays alive."""
        main = threading.main_thread()
        while main.is_alive():
            time.sleep(0.05)
        time.sleep(EXIT_GRACE_S)
        logger.error("enginetap capture: the process did not exit within %.0f s of its "
                     "shutdown after signal %d; flushing the capture and ending it",
                     EXIT_GRACE_S, signum)
        if self.writer is not None:
            self.writer.close()
        self._write_summary()
        os._exit(128 + signum)

    # ---------------------------------------------------------------- hot path
    def _wrapper(self, probe: Probe):
        def capture_call(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
            step = current_step()
            if (step is None or not self.selector.selected(step) or probe.name in self.disabled
                    or not probe.fires_in(step) or not self._inside(probe)):
                return wrapped(*args, **kwargs)
            return self._capture(probe, wrapped, instance, args, kwargs, step)

        return capture_call

    def _inside(self, probe: Probe) -> bool:
        if not probe.inside:
            return True
        module = current_module()
        return module is not None and type(module).__name__.endswith(probe.inside)

    def _capture(self, probe: Probe, wrapped: Any, instance: Any, args: tuple, kwargs: dict,
                 step: Any) -> Any:
        try:
            bound = bind_arguments(probe.signature or wrapped, args, kwargs)
        except (TypeError, ValueError) as exc:  # ours to handle: the engine's call runs on
            self._fail(probe, "binding the call's arguments", exc)
            return wrapped(*args, **kwargs)
        call = ProbeCall(probe, instance, bound, step, current_names())
        claim = self._prepare(call)
        if claim is None:
            return wrapped(*args, **kwargs)
        result = wrapped(*args, **kwargs)  # the engine's own call; its errors propagate
        call.result = result
        self._finish(call, claim)
        return result

    def _prepare(self, call: ProbeCall) -> tuple | None:
        """Definition, claimed variant and snapshot; None when this call is not captured."""
        probe = call.probe
        try:
            definition = probe.define(call)
            if definition is None or not self._wanted_definition(definition):
                self.skipped[f"{probe.name}: not a captured definition"] += 1
                return None
            layer = call.layer[1] if call.layer else ""
            variant = self.selector.variant(call.step, layer)
            if not self.selector.claim(definition.name, variant):
                return None
            call.definition = definition
            if probe.before is not None:
                call.before = probe.before(call)
            return definition, variant
        except Exception as exc:  # noqa: BLE001 - our failure: disable the probe, serve on
            self._fail(probe, "preparing the capture", exc)
            return None

    def _finish(self, call: ProbeCall, claim: tuple) -> None:
        definition, variant = claim
        probe = call.probe
        try:
            extracted = probe.adapt(call)
            if extracted is None:
                self.selector.release(definition.name, variant)
                self.skipped[f"{probe.name}: adapter declined"] += 1
                return
            if self.writer is None:  # other ranks took part in the gathers; rank 0 writes
                return
            facts = self.provenance.facts(call, extracted, variant)
            ring = self.options.budget_bytes  # the pinned ring holds what the budget allows
            groups = [extracted.inputs, extracted.outputs]
            if extracted.checks:
                groups.append({str(i): flag.reshape(1)
                               for i, (flag, _) in enumerate(extracted.checks)})
            copies = groups_for(groups, self.writer, ring)
            item = Item(definition, copies[0], copies[1],
                        PendingReceipt(self.provenance, facts, self.labels),
                        lambda why: self._refused(probe, why),
                        copies[2] if extracted.checks else None,
                        tuple(what for _, what in extracted.checks))
            self.writer.submit(item)
        except Exception as exc:  # noqa: BLE001 - our failure: disable the probe, serve on
            self.selector.release(definition.name, variant)
            self._fail(probe, "adapting the call to its definition", exc)

    def _refused(self, probe: Probe, why: str) -> None:
        """The dataset refused a workload of ``probe`` (writer thread): disable it."""
        self._fail(probe, "storing its workload", ValueError(why))

    def _fail(self, probe: Probe, doing: str, exc: BaseException) -> None:
        self.failures[probe.name] += 1
        if probe.name not in self.disabled:
            why = f"{type(exc).__name__}: {exc}"
            self.disabled[probe.name] = f"{doing}: {why}"
            logger.error("enginetap capture: probe %s disabled after %s failed: %s. The engine "
                         "goes on unchanged. Fix: this engine version or model is not what "
                         "the probe was written for; report it with this message", probe.name,
                         doing, why, exc_info=exc)

    # ---------------------------------------------------------------- filters
    def _wanted_family(self, family: str) -> bool:
        wanted = self.options.definitions
        return not wanted or family in wanted or any(w.startswith(family) for w in wanted)

    def _wanted_definition(self, definition: Definition) -> bool:
        wanted = self.options.definitions
        family = next((t.split("=", 1)[1] for t in definition.tags
                       if t.startswith("enginetap:family=")), "")
        return not wanted or definition.name in wanted or family in wanted

    # ---------------------------------------------------------------- summary
    def summary(self) -> dict[str, Any]:
        stats = self.writer.stats if self.writer is not None else None
        return {
            "rank": self.context.rank, "world_size": self.context.world_size,
            "dataset": str(self.dataset_root),
            "policy": self.options.selection().model_dump(),
            "probes": [p.name for p in self.probes],
            "targets": sorted(self.installed_targets),
            "written": stats.written if stats else 0,
            "bytes_written": stats.bytes_written if stats else 0,
            "per_definition": dict(stats.per_definition) if stats else {},
            "dropped_budget_full": stats.dropped_full if stats else 0,
            "dropped_after_write_error": stats.dropped_after_error if stats else 0,
            "refused_by_dataset": stats.refused if stats else 0,
            "write_error": stats.error if stats else "",
            "probe_failures": dict(self.failures),
            "disabled_probes": dict(self.disabled),
            "skipped": dict(self.skipped),
            "steps_not_selected": self.selector.skipped_steps,
        }

    def _write_summary(self) -> None:
        path = self.context.out_dir / SUMMARY_FILE.format(rank=self.context.rank)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(self.summary(), indent=2, default=str) + "\n")
            os.replace(tmp, path)  # whole, even if the exit watchdog writes it too
        except OSError as exc:
            logger.error("enginetap capture: cannot write %s: %s", path, exc)
