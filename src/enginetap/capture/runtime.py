"""The capture runtime of one armed process: probes installed, steps selected, flushed.

For each probe (from the engine's table, :meth:`EngineHooks.capture_probes`) a wrapper is
installed through the patching layer once a model is loaded (class-suffix targets are
resolved against that model). The wrappers (:mod:`enginetap.capture.calls`, the hot
path), and the module scope's, run only on selected steps: outside them their gate is
shut and wrapt calls the engine's function directly (a few hundred nanoseconds per call,
no Python frame). The writer (:mod:`enginetap.capture.writers`) is flushed and the
summary (:mod:`enginetap.capture.summary`) written at close, at exit and after SIGTERM or
SIGINT (:mod:`enginetap.core.shutdown`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from enginetap.capture.calls import ProbeCalls
from enginetap.capture.labels import RequestLabels
from enginetap.capture.options import CaptureOptions
from enginetap.capture.probe import Probe
from enginetap.capture.writers.provenance import Provenance, model_identity
from enginetap.capture.selection import Selector
from enginetap.capture.summary import CaptureSummary
from enginetap.capture.writers import CaptureWriter, ProcessWriter, ThreadWriter
from enginetap.core import context, shutdown
from enginetap.core.capability import ArmContext
from enginetap.core.patching import Gate, PatchSet
from enginetap.core.scope import ScopeUse, SublayerSpec, sublayer_classes
from enginetap.dataset import Dataset

logger = logging.getLogger("enginetap.capture")

__all__ = ["CaptureRuntime", "start_writer"]


def start_writer(dataset: Dataset, options: CaptureOptions) -> CaptureWriter:
    """The writer ``options`` ask for; the thread writer when a writer process cannot
    start (logged with what/why/fix)."""
    if options.writer == "process":
        try:
            return ProcessWriter(dataset.root, budget_bytes=options.budget_bytes,
                                 when_full=options.when_full, batch=options.batch)
        except OSError as exc:  # no memfd, no room to map the ring, cannot spawn
            logger.warning("enginetap capture: cannot start the writer process (%s); "
                           "writing from a thread of this process instead. Fix: "
                           "lower options.capture.budget_bytes or free memory", exc)
    return ThreadWriter(dataset, budget_bytes=options.budget_bytes,
                        when_full=options.when_full, batch=options.batch,
                        switch_interval_s=options.switch_interval_s)


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
        self.writer: CaptureWriter | None = None
        if context_.rank != 0:
            # Every rank takes part in the probes' gathers, so a directory that disarms
            # rank 0 (below) must disarm the others too, or they would gather alone. The
            # ranks share a file system; creating the root is what rank 0 does first.
            self.dataset_root.mkdir(parents=True, exist_ok=True)
        if context_.rank == 0:  # rank 0 writes the logical op, rebuilt from every rank
            self.writer = start_writer(Dataset(self.dataset_root, create=True), options)
        self.calls = ProbeCalls(options, self.selector, self.provenance, self.labels,
                                self.writer)
        self.patches = PatchSet("capture")
        self.gate = Gate(is_open=False, detach=True)
        """Open during selected steps only (set only through :meth:`_select`)."""
        scope = context_.notes.get("scope")
        self.scope: ScopeUse | None = scope if isinstance(scope, ScopeUse) else None
        self.installed_targets: set[str] = set()
        self._installed: set[tuple[str, str]] = set()
        self._closed = False

    # ---------------------------------------------------------------- lifecycle
    def install(self) -> CaptureRuntime:
        if self.scope is not None:
            self.scope.part_time("capture")
        context.subscribe(on_begin=self._on_begin, on_end=self._on_end)
        self.context.hooks.on_model_loaded(self.add_model)
        # a stuck exit: the writer shares no lock with the engine thread
        shutdown.on_exit(self.close, stuck=self._flush)
        return self

    def uninstall(self) -> None:
        self.patches.uninstall()
        context.unsubscribe(self._on_begin)
        context.unsubscribe(self._on_end)
        self._select(False)
        self.close()
        shutdown.forget(self.close)

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
                    new.append((target, self.calls.wrapper(probe)))
        self.patches.install_more(new, self.gate)

    def _targets(self, probe: Probe, model: Any) -> list[str]:
        if probe.target:
            return [probe.target]
        classes = sublayer_classes(model, SublayerSpec(suffixes=(probe.suffix,)))
        return [f"{c.__module__}:{c.__qualname__}.{probe.method}" for c in classes]

    def close(self) -> CaptureSummary:
        """Flush the writer and write the summary (idempotent); returns the summary."""
        if not self._closed:
            self._closed = True
            self._flush()
        return self.summary()

    def _flush(self) -> None:
        """Flush the writer and write the summary, closed or not (the exit watchdog's
        flush when the shutdown is stuck, maybe inside :meth:`close`)."""
        if self.writer is not None:
            self.writer.close()
        self.summary().write(self.context.out_dir)

    # ---------------------------------------------------------------- filters
    def _wanted_family(self, family: str) -> bool:
        wanted = self.options.definitions
        return not wanted or family in wanted or any(w.startswith(family) for w in wanted)

    # ---------------------------------------------------------------- summary
    def summary(self) -> CaptureSummary:
        """What this rank captured, dropped and why, so far."""
        calls = self.calls
        summary = CaptureSummary(
            rank=self.context.rank, world_size=self.context.world_size,
            dataset=str(self.dataset_root), policy=self.options.selection(),
            probes=[p.name for p in self.probes], targets=sorted(self.installed_targets),
            probe_failures=dict(calls.failures), disabled_probes=dict(calls.disabled),
            skipped=dict(calls.skipped), steps_not_selected=self.selector.skipped_steps)
        return summary.with_writer(self.writer.stats if self.writer is not None else None)
