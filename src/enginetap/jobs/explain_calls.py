"""The culprit op's calls, caught during a re-run and called again in other batches.

:class:`Catcher` wraps every capture probe's target of the engine (outermost, after the
engine armed: what it sees is what the engine's own wrappers and patches produce) and, at
one step, keeps each call made inside one module: the bound arguments (cloned before the
call), the engine's function below the wrapper, the step's row metadata, and the call in
its definition's canonical layout (the probe's own ``define``/``adapt``, as capture does).

:func:`call_again` runs a kept call's function on a batch made of some of its batch rows
(one row alone, one row at every position, the whole batch again) and turns that call
into the definition's layout through the same probe, with a step whose row metadata is
the selected rows'. A row's canonical slice (:class:`Layout`) is its token rows for
token-shaped tensors, its request's entry for per-request ones.
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

__all__ = ["Caught", "Catcher", "Layout", "call_again", "common_rows", "first_tensor",
           "request_inputs"]


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
        if model is None:  # no model object at hand (vLLM's): class-suffix probes left out
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


# ---------------------------------------------------------------------- layout
@dataclass
class Layout:
    """Which step rows each batch row of a padded call holds, in step order."""

    batch_rows: list[int]
    rows: list[list[int]]
    columns: list[list[int]]
    keys: list[str]
    width: int
    """Columns of the padded batch; 0 for an engine that runs flat token rows (vLLM), where
    a request is its rows, contiguous in step order."""

    @classmethod
    def of(cls, step: Step) -> Layout:
        shape = step.extra.get("input_shape")
        if not shape:
            return cls._flat(step)
        width = int(shape[1])
        index = step.rows.token_index or list(range(len(step.rows)))
        order: dict[int, int] = {}
        layout = cls([], [], [], [], width)
        for row, flat in enumerate(index):
            b, column = divmod(flat, width)
            if b not in order:
                order[b] = len(layout.batch_rows)
                layout.batch_rows.append(b)
                layout.rows.append([])
                layout.columns.append([])
                layout.keys.append(step.rows.keys[row])
            layout.rows[order[b]].append(row)
            layout.columns[order[b]].append(column)
        return layout

    @classmethod
    def _flat(cls, step: Step) -> Layout:
        layout = cls([], [], [], [], 0)
        for row, key in enumerate(step.rows.keys):
            if not layout.keys or layout.keys[-1] != key:
                layout.batch_rows.append(row)
                layout.rows.append([])
                layout.keys.append(key)
                layout.columns.append([])
            layout.rows[-1].append(row)
            layout.columns[-1].append(row)
        return layout

    def where(self, j: int) -> str:
        """Request ``j``'s place in the batch, in words."""
        if self.width:
            return f"batch row {self.batch_rows[j]} of {len(self.rows)}"
        rows = self.rows[j]
        return (f"token rows {rows[0]}-{rows[-1]} of {sum(len(r) for r in self.rows)} "
                f"(request {j} of {len(self.rows)})")

    def request(self, key: str) -> int:
        """The index (in step order) of ``key``'s batch row."""
        return self.keys.index(key)

    def slice(self, tensor: Any, j: int, limit: int | None = None) -> torch.Tensor | None:
        """Request ``j``'s part of a canonical tensor: its token rows (the first ``limit``
        of them), or its entry of a per-request tensor; None for tensors shared by the
        batch."""
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            return None
        n_rows = sum(len(r) for r in self.rows)
        if tensor.shape[0] == n_rows and n_rows != len(self.rows):
            return tensor[self.rows[j][:limit]]
        if tensor.shape[0] == len(self.rows):
            return tensor[j:j + 1]
        return None


def common_rows(a: Step, key_a: str, b: Step, key_b: str) -> int:
    """How many leading token rows (in position order) two requests share: same
    positions and token ids (a pair's same-prefix rows; all of one request in two runs)."""
    rows_a = sorted((a.rows.positions[r], a.rows.token_ids[r]) for r in a.rows.rows_of_key(key_a))
    rows_b = sorted((b.rows.positions[r], b.rows.token_ids[r]) for r in b.rows.rows_of_key(key_b))
    n = 0
    while n < min(len(rows_a), len(rows_b)) and rows_a[n] == rows_b[n]:
        n += 1
    return n


def request_inputs(inputs: dict[str, Any], layout: Layout, j: int,
                   limit: int | None = None) -> dict[str, torch.Tensor]:
    """Request ``j``'s part of every canonical input that has one: row- or
    request-shaped tensors (the first ``limit`` token rows), segments of an ``*_indptr``,
    a paged cache's pages. Page numbers and pointers are layout, not data: left out."""
    n = len(layout.rows)
    ptrs = {name: v for name, v in inputs.items() if name.endswith("_indptr")
            and isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == n + 1}
    out: dict[str, torch.Tensor] = {}
    for name, v in inputs.items():
        if not isinstance(v, torch.Tensor) or name.endswith(("_indptr", "indices")):
            continue
        if v.dim() < 2 and v.is_floating_point():
            continue  # per-head constants (A_log, dt_bias), weights
        part = _segment(v, ptrs, j, limit)
        if part is None and name.endswith("_cache") and "kv_indices" in inputs \
                and "kv_indptr" in ptrs:
            p = ptrs["kv_indptr"]
            part = v[inputs["kv_indices"][int(p[j]):int(p[j + 1])].long()]
        if part is None:
            part = layout.slice(v, j, limit)
        if part is not None:
            out[name] = part
    return out


def _segment(v: torch.Tensor, ptrs: dict[str, torch.Tensor], j: int,
             limit: int | None) -> torch.Tensor | None:
    for p in ptrs.values():
        if v.shape[0] == int(p[-1]) and v.dim() >= 2:
            end = int(p[j + 1]) if limit is None else min(int(p[j + 1]), int(p[j]) + limit)
            return v[int(p[j]):end]
    return None


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
