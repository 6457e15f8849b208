"""Capabilities as plug-ins: a name, an options model and an install function.

A feature (``guard``, ``capture``, ``tap``) describes itself once as a
:class:`Capability`; the explicit list of them lives in :mod:`enginetap.capabilities`,
above every feature, so core imports no feature. The arming config names capabilities and
holds their options; both are validated when the config is parsed
(:meth:`CapabilityRegistry.validate`), never later inside an engine.

An install function receives one :class:`ArmContext`: the config, its own validated
options, rank and world size, the output directory and the :class:`EngineHooks` of the
engine it arms. It returns what it installed (anything with ``uninstall()``, or None) and
a one-line description for the arming summary. Features never read the environment: the
engine's entry point resolved the config before anything was installed, and
:func:`current_arming` tells code running inside the engine (a guard patch) what is armed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ValidationError

from enginetap.core.patching import resolve
from enginetap.errors import ConfigError, PatchError, describe_validation

__all__ = ["ArmContext", "Capability", "CapabilityRegistry", "EngineHooks", "Installed",
           "InstalledGroup",
           "current_arming", "set_current_arming"]


class Installed(Protocol):
    def uninstall(self) -> None: ...


class InstalledGroup:
    """Several installed things uninstalled as one, last first."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts

    def uninstall(self) -> None:
        while self.parts:
            self.parts.pop().uninstall()


class ArmSpec(Protocol):
    """What core needs of an arming config (:class:`enginetap.config.ArmConfig`)."""

    enabled: bool
    capabilities: list[str]
    out_dir: Path
    request_filter: str
    options: dict[str, Any]


InstallResult = tuple[Installed | None, str]
InstallFunction = Callable[["ArmContext"], InstallResult]


@dataclass(frozen=True)
class Capability:
    """One plug-in: ``install`` is ``"module:function"`` (imported only when arming) or a
    function; ``needs`` are capabilities installed before it (``step`` for most)."""

    name: str
    options: type[BaseModel]
    install: str | InstallFunction
    summary: str
    needs: tuple[str, ...] = ("step",)
    running_scope: bool = True
    """Where it needs ``scope``: whether it reads the running sublayer (the scope's
    wrappers), or only the scope's module names (False: then, armed alone with it, the
    scope installs no wrapper)."""

    def install_function(self) -> InstallFunction:
        """Raises: ConfigError: the install function cannot be imported."""
        if callable(self.install):
            return self.install
        try:
            return resolve(self.install)
        except PatchError as exc:
            raise ConfigError(f"capability {self.name!r} cannot be installed", exc.why,
                              "reinstall enginetap; this is a packaging error") from None


class CapabilityRegistry:
    """An explicit, ordered list of capabilities (installation follows this order)."""

    def __init__(self, capabilities: Iterable[Capability]) -> None:
        self._items = {c.name: c for c in capabilities}

    @property
    def names(self) -> list[str]:
        return list(self._items)

    def get(self, name: str) -> Capability:
        """Raises: ConfigError: no capability of that name."""
        try:
            return self._items[name]
        except KeyError:
            raise ConfigError(f"unknown capability {name!r}",
                              f"enginetap has {', '.join(self._items)}",
                              "name only those capabilities") from None

    def order(self, names: Iterable[str]) -> list[str]:
        """``names`` plus what they need, in registry order. Raises: ConfigError."""
        wanted: set[str] = set()
        pending = list(names)
        while pending:
            name = pending.pop()
            if name not in wanted:
                wanted.add(name)
                pending.extend(self.get(name).needs)
        return [n for n in self._items if n in wanted]

    def validate(self, names: Sequence[str], options: dict[str, Any]) -> dict[str, BaseModel]:
        """Every registered capability's options (defaults where ``options`` has none),
        validated; unknown names in ``names`` or ``options`` are refused.

        Raises:
            ConfigError: an unknown capability, options for one that is not known, or
                invalid options (every invalid field named).
        """
        self.order(names)
        unknown = [k for k in options if k not in self._items]
        if unknown:
            raise ConfigError(f"options for unknown capability {', '.join(map(repr, unknown))}",
                              f"enginetap has {', '.join(self._items)}",
                              "remove those keys from 'options'")
        parsed = {}
        for name in self._items:
            raw = options.get(name, {})
            try:
                parsed[name] = self._items[name].options.model_validate(raw)
            except ValidationError as exc:
                raise ConfigError(f"invalid options.{name} in the enginetap arming config",
                                  describe_validation(exc),
                                  f"use only the fields of {name}'s options "
                                  f"({', '.join(self._items[name].options.model_fields)})"
                                  ) from None
        return parsed


class EngineHooks:
    """What only the engine knows, supplied by its adapter; the defaults suit an engine
    that publishes its own steps (the built-in one).

    - :meth:`install_step_source` makes the engine publish steps; returns what it
      installed and a description, or None when the engine cannot (then nothing that
      needs steps is armed);
    - :meth:`on_model_loaded` registers a callback run with each model the engine loads
      (before its first step): module scope, capture probes on instances, self-checks;
    - :meth:`sublayer_targets` names the sublayer entry points of a loaded model;
    - :meth:`tap_points` names the engine's kernel-level tap points of a loaded model
      (KV rows, recurrent state, logits), each with its wrapper factory;
    - :meth:`tp_group` is the tensor-parallel group (None: the default or none);
    - :meth:`capture_probes` is the engine's probe table (data, see
      :mod:`enginetap.capture.probe`), :meth:`engine_version` its version for receipts.
    """

    engine = "engine"

    def __init__(self) -> None:
        self._loaded: list[Callable[[Any], None]] = []
        self._models: list[Any] = []

    def install_step_source(self, context: ArmContext) -> InstallResult | None:
        return None, "step"

    def on_model_loaded(self, callback: Callable[[Any], None]) -> None:
        self._loaded.append(callback)
        for model in self._models:
            callback(model)

    def model_loaded(self, model: Any) -> None:
        """Called by the adapter once per loaded model; runs every registered callback."""
        self._models.append(model)
        for callback in list(self._loaded):
            callback(model)

    def sublayer_targets(self, model: Any) -> list[str]:
        return []

    def tap_points(self, model: Any) -> list[tuple[str, Callable[..., Any]]]:
        """``(target, factory)`` pairs; the tap installs ``factory(recorder, names)`` (a
        wrapper) on each target (none by default)."""
        return []

    def tp_group(self) -> Any:
        return None

    def capture_probes(self) -> list[Any]:
        return []

    def engine_version(self) -> str:
        return ""


@dataclass
class ArmContext:
    """Handed to every install function; one per armed engine process."""

    config: ArmSpec
    capabilities: list[str]
    """What is armed, in installation order (needs included)."""
    options: dict[str, BaseModel]
    hooks: EngineHooks
    rank: int = 0
    world_size: int = 1
    notes: dict[str, Any] = field(default_factory=dict)
    dependents: dict[str, list[str]] = field(default_factory=dict)
    """For each armed capability, the armed capabilities that need it."""
    running_scope: bool = True
    """Whether anything armed reads the running sublayer (``scope`` armed with nothing
    that needs it, or a capability needing it with ``running_scope``): else the scope
    only names modules."""

    @property
    def out_dir(self) -> Path:
        return Path(self.config.out_dir)

    def options_of(self, capability: str) -> BaseModel:
        """This capability's validated options (its defaults when the config has none)."""
        return self.options[capability]


_CURRENT: ArmContext | None = None


def current_arming() -> ArmContext | None:
    """The arming of this process while one is installed, else None (disarmed)."""
    return _CURRENT


def set_current_arming(context: ArmContext | None) -> None:
    global _CURRENT
    _CURRENT = context
