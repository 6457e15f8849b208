"""The culprit op's calls, caught during a re-run and called again in other batches.

:class:`Catcher` wraps every capture probe's target of the engine (outermost, after the
engine armed: what it sees is what the engine's own wrappers and patches produce) and, at
one step, keeps each call made inside one module: the bound arguments (cloned before the
call), the engine's function below the wrapper, the step's row metadata, and the call in
its definition's canonical layout (the probe's own ``define``/``adapt``, as capture does).

:func:`call_again` runs a kept call's function on a batch made of some of its batch rows
(one row alone, one row at every position, the whole batch again) and turns that call
into the definition's layout through the same probe, with a step whose row metadata is
the selected rows' (:class:`~enginetap.jobs.explain_layout.Layout` says which rows a
request holds).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from enginetap.capture.probe import Extracted, Probe, ProbeCall
from enginetap.core.context import Step, StepRows, current_step
from enginetap.core.patching import PatchSet, bind_arguments
from enginetap.core.scope import (SCOPE, SublayerSpec, _enter_module, current_module,
                                  current_names, sublayer_classes)
from enginetap.dataset.schema import Definition
from enginetap.jobs.explain_layout import Layout

__all__ = ["Caught", "Catcher", "call_again", "first_tensor"]


@dataclass
class Caught:
    """One probed call made inside the culprit module at the culprit step."""

    probe: Probe
    definition: Definition
    function: Any
    """The engine's function below our wrapper (a bound method for module targets)."""
    instance: Any
    scope_module: Any
    """The sublayer running the call (kernel-level targets read it in ``define``)."""
    args: dict[str, Any]
    """Bound arguments, cloned before the call."""
    step: Step
    layer: tuple[str, str] | None
    module: str
    extracted: Extracted
    """The call in canonical layout, on the host."""
    target: str
    """The engine's function, ``module:Qualname``."""


class Catcher:
    """Keeps the probed calls made inside ``module`` (a scope short name) at ``step``."""

    def __init__(self, probes: list[Probe], step: int, module: str) -> None:
        self.probes, self.step, self.module = probes, step, module
        self.caught: list[Caught] = []
        self.declined: list[str] = []
        self.patches = PatchSet("explain")

    def add_model(self, model: Any, sublayers: list[str]) -> None:
        """Wrap every probe's targets in ``model``, and its ``sublayers`` (targets) with
        the scope's running-module wrapper: armed with the tap only, the scope names
        modules but does not track the running one, which kernel-level probes read."""
        targets: list[tuple[str, Any]] = [(t, _enter_module) for t in sublayers]
        for probe in self.probes:
            for target in self._targets(probe, model):
                targets.append((target, self._wrapper(probe, target)))
        self.patches.install_more(targets)

    def uninstall(self) -> None:
        self.patches.uninstall()

    def covers(self, model: Any) -> bool:
        """Whether some probe can fire inside the culprit module of ``model``: a probed
        class there (norms, experts), or a kernel probed inside a class there."""
        own = {id(m) for m in model.modules()}
        classes = [type(m).__name__ for m, _, short in SCOPE.items()
                   if (short == self.module or short.startswith(self.module + "."))
                   and id(m) in own]
        return any(any(c.endswith(p.suffix or p.inside) for c in classes)
                   if (p.suffix or p.inside) else bool(classes) for p in self.probes)

    @staticmethod
    def _targets(probe: Probe, model: Any) -> list[str]:
        if probe.target:
            return [probe.target]
        if model is None:  # no model object at hand: class-suffix probes left out
            return []
        classes = sublayer_classes(model, SublayerSpec(suffixes=(probe.suffix,)))
        return [f"{c.__module__}:{c.__qualname__}.{probe.method}" for c in classes]

    def _inside(self, instance: Any, probe: Probe) -> str | None:
        """The short name of the module the call belongs to, when it is the culprit's."""
        running = current_module()
        if probe.inside and (running is None
                             or not type(running).__name__.endswith(probe.inside)):
            return None
        own = SCOPE.short(instance) if instance is not None else None
        names = current_names()
        name = own or (names[1] if names else None)
        if name is None or not (name == self.module or name.startswith(self.module + ".")):
            return None
        return name

    def _wrapper(self, probe: Probe, target: str):
        def catch(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
            step = current_step()
            if step is None or step.step != self.step or not probe.fires_in(step):
                return wrapped(*args, **kwargs)
            name = self._inside(instance, probe)
            call = None if name is None else self._prepare(probe, wrapped, instance, args,
                                                           kwargs, step, name)
            if call is None:
                return wrapped(*args, **kwargs)
            kept = _cloned(call.args)
            result = call.result = wrapped(*args, **kwargs)  # the engine's own call
            try:
                extracted = _to_host(_checked(probe.adapt(call), probe))
            except Exception as exc:  # noqa: BLE001 - ours: say why, the engine goes on
                self.declined.append(f"{probe.name} in {name}: {type(exc).__name__}: {exc}")
                return result
            assert call.definition is not None  # _prepare keeps defined calls only
            self.caught.append(Caught(probe, call.definition, wrapped, instance,
                                      current_module(), kept, step, call.layer, name,
                                      extracted, target))
            return result

        return catch

    def _prepare(self, probe: Probe, wrapped: Any, instance: Any, args: tuple, kwargs: dict,
                 step: Step, name: str) -> ProbeCall | None:
        """The call bound, defined and snapshotted; None (with the reason kept) when the
        probe does not describe it or our code failed: the engine's call runs as it is."""
        try:
            bound = bind_arguments(probe.signature or wrapped, args, kwargs)
            call = ProbeCall(probe, instance, bound, step, current_names())
            call.definition = probe.define(call)
            if call.definition is None:
                self.declined.append(f"{probe.name} in {name}")
                return None
            if probe.before is not None:
                call.before = probe.before(call)
            return call
        except Exception as exc:  # noqa: BLE001 - ours: say why, the engine goes on
            self.declined.append(f"{probe.name} in {name}: {type(exc).__name__}: {exc}")
            return None


def _cloned(bound: dict[str, Any]) -> dict[str, Any]:
    return {k: _mapped(v, lambda t: t.detach().clone()) for k, v in bound.items()}


def first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor in ``value`` (through tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, dict) else \
        value if isinstance(value, (tuple, list)) else ()
    return next((t for v in items if (t := first_tensor(v)) is not None), None)


def _mapped(value: Any, change: Any) -> Any:
    """``value`` with ``change`` applied to every tensor in it (through tuples, lists and
    dicts: a ``forward(*args, **kwargs)`` binds its tensors inside them)."""
    if isinstance(value, torch.Tensor):
        return change(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_mapped(v, change) for v in value)
    if isinstance(value, dict):
        return {k: _mapped(v, change) for k, v in value.items()}
    return value


def _to_host(extracted: Extracted) -> Extracted:
    def host(v: Any) -> Any:
        return v.detach().to("cpu").clone() if isinstance(v, torch.Tensor) else v

    return Extracted({k: host(v) for k, v in extracted.inputs.items()},
                     {k: host(v) for k, v in extracted.outputs.items()}, list(extracted.notes))


def _checked(extracted: Extracted | None, probe: Probe) -> Extracted:
    if extracted is None:
        raise ValueError(f"probe {probe.name} declined the call")
    for flag, what in extracted.checks:
        if not bool(flag.all()):
            raise ValueError(f"probe {probe.name}: {what}")
    return extracted


# ---------------------------------------------------------------------- calling again
def _sub_rows(step: Step, layout: Layout, picks: list[int]) -> StepRows:
    """Row metadata of a batch made of ``picks`` (request indices, repeats allowed)."""
    order = [row for j in picks for row in layout.rows[j]]
    values: dict[str, Any] = {}
    for f in fields(StepRows):
        value = getattr(step.rows, f.name)
        if isinstance(value, list):
            values[f.name] = [value[r] for r in order]
        elif isinstance(value, dict):
            values[f.name] = {g: [v[r] for r in order] for g, v in value.items()}
        else:
            values[f.name] = value
    values["token_index"] = (list(range(len(order))) if not layout.width else
                             [b * layout.width + c for b, j in enumerate(picks)
                              for c in layout.columns[j]])
    starts, at = [], 0
    for j in picks:
        starts += [at] * len(layout.rows[j])
        at += len(layout.rows[j])
    values["query_start"] = starts
    values["request_ids"] = [f"{rid}#{b}" for b, j in enumerate(picks)
                             for rid in [step.rows.request_ids[r] for r in layout.rows[j]]]
    return StepRows(**values)


def call_again(caught: Caught, picks: list[int]) -> Extracted:
    """Run the engine's function on a batch of the caught call's requests ``picks``
    (indices in step order; repeats allowed) and return that call in canonical layout.
    A padded engine's batch rows are picked (tensors whose first dimension is the batch),
    a flat engine's token rows (tensors whose first dimension is the step's tokens)."""
    layout = Layout.of(caught.step)
    step = caught.step
    if layout.width:
        size = int(step.extra["input_shape"][0])
        index = [layout.batch_rows[j] for j in picks]
        shape = list(step.extra["input_shape"])
        padded: int | None = len(picks) * layout.width
        extra = {**step.extra, "input_shape": [len(picks), *shape[1:]]}
    else:
        size = step.padded_tokens or len(step.rows)
        index = [row for j in picks for row in layout.rows[j]]
        padded, extra = None, dict(step.extra)
    if caught.probe.regroup is not None:  # per-request metadata or state slots
        args = caught.probe.regroup(caught.args, picks)
    else:
        args = {k: _mapped(v, lambda t: _pick(t, size, index)) for k, v in caught.args.items()}
    sub = replace(step, rows=_sub_rows(step, layout, picks), padded_tokens=padded,
                  extra=extra, _device={}, _memo={})

    def run() -> Extracted:
        call = ProbeCall(caught.probe, caught.instance, args, sub, caught.layer)
        call.definition = caught.probe.define(call)
        if caught.probe.before is not None:
            call.before = caught.probe.before(call)
        with torch.inference_mode():
            call.result = _invoke(caught.function, args)
        return _to_host(_checked(caught.probe.adapt(call), caught.probe))

    if caught.scope_module is None:
        return run()
    return _enter_module(lambda: run(), caught.scope_module, (), {})


def _pick(value: torch.Tensor, size: int, index: list[int]) -> torch.Tensor:
    if value.dim() and value.shape[0] == size:
        return value.index_select(0, torch.tensor(index, device=value.device))
    return value.clone()


def _invoke(function: Any, args: dict[str, Any]) -> Any:
    """Call ``function`` with arguments bound by name, ``*args``/``**kwargs`` spread."""
    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin (SDPA): its parameters take keywords
        return function(**args)
    if not args.keys() <= params.keys():  # bound by the probe's own signature: keywords
        return function(**args)
    spread = any(p.kind is p.VAR_POSITIONAL for p in params.values())
    positional: list[Any] = []
    named: dict[str, Any] = {}
    for name, p in params.items():
        if name not in args:
            continue
        if p.kind is p.VAR_POSITIONAL:
            positional.extend(args[name])
        elif p.kind is p.VAR_KEYWORD:
            named.update(args[name])
        elif p.kind is p.POSITIONAL_ONLY or spread:
            positional.append(args[name])
        else:
            named[name] = args[name]
    return function(*positional, **named)
