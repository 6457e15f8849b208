"""Module scope: which layer and sublayer of the model is running right now, by name.

:class:`ModuleScope` maps each module instance of a loaded model to its qualified name
(``model.layers.3.mlp.gate``) and a stable short name (``L3.moe.gate``): capture records
which layer a workload came from, tap names its checkpoints with it.
:func:`current_module` is the innermost sublayer whose ``forward`` is running; it is kept
by wrappers on the sublayer classes, installed by the ``scope`` capability.

The wrappers run only while someone needs them (:class:`ScopeUse`): a capability that
needs the scope on some steps only (capture, on its selected steps) says so, and on the
other steps the wrappers' gate is shut (the engine's own ``forward`` runs, called by wrapt
directly).

Which classes are sublayers is data per engine (:class:`SublayerSpec`: class-name suffixes
for transformers, class paths for vLLM), resolved by one function, :func:`sublayer_classes`.
Patching the class (never the instance) keeps enginetap off the engine's objects.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from weakref import WeakKeyDictionary

from pydantic import BaseModel, ConfigDict

from enginetap.core.capability import ArmContext, Capability, InstallResult
from enginetap.core.patching import Gate, PatchSet, ResolveError, resolve

__all__ = ["SCOPE", "SCOPE_CAPABILITY", "ModuleScope", "ScopeOptions", "ScopeUse",
           "SublayerSpec", "current_module", "current_names", "install_scope", "short_name",
           "sublayer_classes", "sublayer_targets"]

_ALIASES = {"self_attn": "attn", "attention": "attn", "self_attention": "attn",
            "linear_attn": "gdn", "input_layernorm": "in_norm",
            "post_attention_layernorm": "post_norm", "pre_feedforward_layernorm": "pre_ff_norm",
            "post_feedforward_layernorm": "post_ff_norm", "shared_expert": "shared",
            "shared_experts": "shared", "embed_tokens": "embed", "block_sparse_moe": "moe",
            "feed_forward": "mlp", "indexer": "indexer"}
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)(?:\.|$)")


def short_name(qualname: str, is_moe: bool = False) -> str:
    """``model.layers.3.mlp.gate`` → ``L3.mlp.gate`` (``L3.moe.gate`` when ``is_moe``
    says layer 3's ``mlp`` is a mixture of experts); names outside layers keep their
    last part (``model.norm`` → ``norm``, ``lm_head``)."""
    match = _LAYER.search(qualname)
    if match is None:
        return _ALIASES.get(qualname.rpartition(".")[2], qualname.rpartition(".")[2]) or "model"
    parts = [p for p in qualname[match.end():].split(".") if p]
    named = [_ALIASES.get(p, p) for p in parts]
    if named and named[0] == "mlp" and is_moe:
        named[0] = "moe"
    collapsed = [p for i, p in enumerate(named) if i == 0 or p != named[i - 1]]
    return ".".join([f"L{match.group(1)}", *collapsed])


@dataclass(frozen=True)
class SublayerSpec:
    """Which module classes are sublayers: by class-name suffix or by class path."""

    suffixes: tuple[str, ...] = ()
    classes: tuple[str, ...] = ()
    """``"module:Class"`` paths; a class that does not resolve (another engine version)
    is skipped."""

    def matcher(self) -> tuple[tuple[str, ...], tuple[type, ...]]:
        found = []
        for path in self.classes:
            try:
                found.append(resolve(path))
            except ResolveError:
                continue
        return self.suffixes, tuple(c for c in found if isinstance(c, type))


def sublayer_classes(model: Any, spec: SublayerSpec) -> list[type]:
    """The classes of ``model``'s modules that ``spec`` names, sorted by path."""
    suffixes, classes = spec.matcher()
    picked = {type(m) for m in model.modules()
              if (suffixes and type(m).__name__.endswith(suffixes))
              or (classes and isinstance(m, classes))}
    return sorted(picked, key=lambda c: f"{c.__module__}:{c.__qualname__}")


def sublayer_targets(model: Any, spec: SublayerSpec) -> list[str]:
    """Targets ``"module:Class.forward"`` of :func:`sublayer_classes`."""
    return [f"{c.__module__}:{c.__qualname__}.forward" for c in sublayer_classes(model, spec)]


class ModuleScope:
    """Names of the modules of every registered model (weakly held)."""

    def __init__(self) -> None:
        self._names: WeakKeyDictionary[Any, tuple[str, str]] = WeakKeyDictionary()

    def register(self, model: Any) -> None:
        moe_layers = {m.group(1) for name, _ in model.named_modules()
                      if (m := _LAYER.search(name)) and ".experts" in name[m.end() - 1:]}
        for name, module in model.named_modules():
            layer = _LAYER.search(name)
            is_moe = layer is not None and layer.group(1) in moe_layers
            self._names[module] = (name, short_name(name, is_moe))

    def qualname(self, module: Any) -> str | None:
        found = self._names.get(module)
        return None if found is None else found[0]

    def short(self, module: Any) -> str | None:
        found = self._names.get(module)
        return None if found is None else found[1]

    def items(self) -> Iterator[tuple[Any, str, str]]:
        for module, (qualname, short) in list(self._names.items()):
            yield module, qualname, short


SCOPE = ModuleScope()
"""The process's scope: every model loaded while ``scope`` is armed is registered."""

_STACK: list[Any] = []


def current_module() -> Any | None:
    """The innermost sublayer whose ``forward`` is running (None outside any)."""
    return _STACK[-1] if _STACK else None


def current_names() -> tuple[str, str] | None:
    """``(qualified name, short name)`` of :func:`current_module`, if it is registered."""
    module = current_module()
    if module is None:
        return None
    qualname = SCOPE.qualname(module)
    return None if qualname is None else (qualname, SCOPE.short(module) or qualname)


def _enter_module(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    _STACK.append(instance)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _STACK.pop()


class ScopeUse:
    """Who needs the scope's wrappers, and when; they run while anyone does.

    Every armed capability that needs ``scope`` needs it on every step unless it calls
    :meth:`part_time`; from then on it needs it only between its ``need(name, True)``
    and ``need(name, False)`` (capture: on its selected steps). With no such capability
    armed (``scope`` asked for by itself) the wrappers always run.
    """

    def __init__(self, consumers: Iterable[str], gate: Gate) -> None:
        self._always = set(consumers) or {"scope"}
        self._part: dict[str, bool] = {}
        self.gate = gate
        self._update()

    def part_time(self, consumer: str) -> None:
        """``consumer`` needs the scope only when it says so (not until then)."""
        self._always.discard(consumer)
        self._part[consumer] = False
        self._update()

    def need(self, consumer: str, needed: bool) -> None:
        """Part-time ``consumer`` needs the scope from now on (True) or no more (False)."""
        if consumer in self._part and self._part[consumer] is not needed:
            self._part[consumer] = needed
            self._update()

    def _update(self) -> None:
        self.gate.set(bool(self._always) or any(self._part.values()))


@dataclass
class _ScopeInstall:
    """What the ``scope`` capability installed: wrappers on sublayer classes."""

    patches: PatchSet = field(default_factory=lambda: PatchSet("scope"))
    targets: set[str] = field(default_factory=set)
    gate: Gate = field(default_factory=lambda: Gate(detach=True))
    wrap: bool = True
    """Install the wrappers (False: only module names are needed, see
    :attr:`~enginetap.core.capability.ArmContext.running_scope`)."""

    def add_model(self, model: Any, targets: Iterable[str]) -> None:
        SCOPE.register(model)
        if not self.wrap:
            return
        new = [t for t in dict.fromkeys(targets) if t not in self.targets]
        self.targets.update(new)
        self.patches.install_more(((t, _enter_module) for t in new), self.gate)

    def uninstall(self) -> None:
        self.patches.uninstall()
        self.targets.clear()
        _STACK.clear()


class ScopeOptions(BaseModel):
    """``options.scope``: no options; the capability is implied by capture and tap."""

    model_config = ConfigDict(extra="forbid")


def install_scope(context: ArmContext) -> InstallResult:
    """The ``scope`` capability: register each loaded model and wrap its sublayers (not
    where only the tap needs it: it reads module names, never the running sublayer; its
    own wrappers stacked on the scope's would keep them on every call, about 1.8 ms of
    host time per 5120x48 decode step on the H200, BENCHMARKS.md)."""
    installed = _ScopeInstall(wrap=context.running_scope)
    context.notes["scope"] = ScopeUse(context.dependents.get("scope", ()), installed.gate)
    context.hooks.on_model_loaded(
        lambda model: installed.add_model(model, context.hooks.sublayer_targets(model)))
    return installed, "scope (module names, current sublayer)"


SCOPE_CAPABILITY = Capability("scope", ScopeOptions, install_scope,
                              "module names and the running sublayer (for capture and tap)")
