"""The capture's hot path: what a probe's wrapper does on each call of the engine.

On every call the wrapper asks, in this order and cheaply: is a step published and
selected, does the probe fire in this mode and sublayer, is the probe still healthy. Only
then does it bind the call, instantiate the definition, claim a workload slot for the
variant, snapshot in-place state, run the engine's call, adapt and copy the tensors out,
and hand them to the writer.

A probe that fails (engine changed, adapter bug, a workload the definition refuses) is
disabled: logged once with what/why/fix, counted (:attr:`ProbeCalls.failures`,
:attr:`ProbeCalls.disabled`); the engine's call always runs exactly as it would unarmed
and its result is returned untouched.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from enginetap.capture.labels import RequestLabels
from enginetap.capture.options import CaptureOptions
from enginetap.capture.probe import Extracted, Probe, ProbeCall
from enginetap.capture.writers.provenance import Facts, PendingReceipt, Provenance
from enginetap.capture.selection import Selector
from enginetap.capture.writers import CaptureWriter, Item
from enginetap.core.context import current_step
from enginetap.core.patching import bind_arguments
from enginetap.core.scope import current_module, current_names
from enginetap.dataset.schema import Definition

logger = logging.getLogger("enginetap.capture")

__all__ = ["ProbeCalls", "receipt_facts"]


def receipt_facts(call: ProbeCall, extracted: Extracted, variant: tuple) -> Facts:
    """What the receipt needs from the call, taken now (cheap: numbers and strings; no
    reference to the engine's tensors survives the call)."""
    step = call.step
    if extracted.rows is None:  # every row: the same keys for every workload of the step
        keys = list(step.memo("capture.keys", lambda: list(dict.fromkeys(step.rows.keys))))
        count = len(step.rows)
    else:
        keys = list(dict.fromkeys(step.rows.keys[i] for i in extracted.rows))
        count = len(extracted.rows)
    declared = call.definition.outputs if call.definition is not None else {}
    return Facts(step.step, step.mode, keys, call.layer, call.probe.name,
                 call.probe.target or f"*{call.probe.suffix}.{call.probe.method}",
                 variant, count, len(step.rows), list(extracted.notes),
                 [name for name in declared if name not in extracted.outputs])


class ProbeCalls:
    """The probes' wrappers and what they share: the selector, the provenance, the
    writer (None on a rank that only takes part in the gathers) and the counts."""

    def __init__(self, options: CaptureOptions, selector: Selector, provenance: Provenance,
                 labels: RequestLabels, writer: CaptureWriter | None) -> None:
        self.options = options
        self.selector = selector
        self.provenance = provenance
        self.labels = labels
        self.writer = writer
        self.failures: Counter[str] = Counter()
        self.disabled: dict[str, str] = {}
        self.skipped: Counter[str] = Counter()

    def wrapper(self, probe: Probe) -> Callable[..., Any]:
        """The wrapt wrapper of ``probe``: the engine's call, captured when selected."""
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
            facts = receipt_facts(call, extracted, variant)
            ring = self.options.budget_bytes  # the pinned ring holds what the budget allows
            groups = [extracted.inputs, extracted.outputs]
            if extracted.checks:
                groups.append({str(i): flag.reshape(1)
                               for i, (flag, _) in enumerate(extracted.checks)})
            copies = self.writer.host_copies(groups, ring)
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

    def _wanted_definition(self, definition: Definition) -> bool:
        wanted = self.options.definitions
        family = next((t.split("=", 1)[1] for t in definition.tags
                       if t.startswith("enginetap:family=")), "")
        return not wanted or definition.name in wanted or family in wanted
