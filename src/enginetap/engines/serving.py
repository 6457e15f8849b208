"""What arming inside a serving engine's own processes shares (vLLM workers, SGLang
scheduler processes): the hooks such an engine supplies alike (sublayers by a spec, its
tensor-parallel group, capture probes checked against its drift lock) and the process's
one arming, armed once and disarmed once. Any failure is logged and the process disarms
itself; the engine serves on.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from enginetap.capabilities import arm as arm_capabilities
from enginetap.capture.drift import ProbeLock
from enginetap.config import ArmConfig
from enginetap.core.arming import Arming
from enginetap.core.capability import EngineHooks
from enginetap.core.ranks import rank_world, set_group_resolver
from enginetap.core.scope import SublayerSpec, sublayer_targets

__all__ = ["ProcessArming", "ServingHooks"]


class ServingHooks(EngineHooks, ABC):
    """Hooks of an engine whose processes we arm; an engine names its sublayers, its TP
    group and its probe lock, and adds its step source and tap points."""

    sublayers: ClassVar[SublayerSpec]
    """The engine's sublayers: its model files' decoder/attention/MLP/MoE classes by
    suffix, and its shared layer classes by path (a path missing in another version of
    the engine is skipped)."""
    group: ClassVar[Callable[[], Any]]
    """The engine's tensor-parallel device group (raises until the engine made it)."""

    def __init__(self) -> None:
        super().__init__()
        self.refused_probes: dict[str, str] = {}
        """Capture probes refused by the drift lock, with the reason (see capture_probes)."""

    def install(self) -> ServingHooks:
        """Install what the hooks patch themselves (nothing by default)."""
        return self

    def uninstall(self) -> None:
        """Remove what :meth:`install` patched."""

    def sublayer_targets(self, model: Any) -> list[str]:
        return sublayer_targets(model, self.sublayers)

    def tp_group(self) -> Any:
        return type(self).group()

    @abstractmethod
    def probe_lock(self) -> ProbeLock:
        """The engine's probe table and its shipped drift lock."""

    def capture_probes(self) -> list[Any]:
        """The probes whose sources still match the shipped capture drift lock; a drifted
        group is refused by name (logged) and the engine serves on."""
        kept, self.refused_probes = self.probe_lock().checked_probes()
        return kept


class ProcessArming:
    """This process's one arming (``where``: the process in the log, e.g. "vLLM worker")."""

    def __init__(self, where: str, logger: logging.Logger) -> None:
        self.where, self.logger = where, logger
        self.arming: Arming | None = None
        self.hooks: ServingHooks | None = None

    def arm(self, config: ArmConfig, hooks: Callable[[], ServingHooks]) -> ServingHooks | None:
        """Arm this process with ``hooks()`` unless it tried before; the hooks when armed,
        None when arming failed (logged, and nothing stays installed)."""
        if self.hooks is not None:
            return self.hooks if self.arming is not None else None
        self.hooks = made = hooks()
        try:
            set_group_resolver(made.tp_group)
            rank, world = rank_world()
            made.install()
            self.arming = arm_capabilities(config, made, rank, world)
        except Exception:
            self.logger.exception("enginetap: arming this %s failed; it runs without "
                                  "enginetap", self.where)
            made.uninstall()
            set_group_resolver(None)
            return None
        self.logger.info("%s", self.arming.summary())
        return made

    def disarm(self) -> None:
        """Uninstall what this process armed (it is not armed again in this process)."""
        if self.arming is not None and self.arming.installed:
            self.arming.uninstall()
            self.arming = None
            if self.hooks is not None:
                self.hooks.uninstall()
            set_group_resolver(None)
            self.logger.warning("enginetap: disarmed in %s pid %d", self.where, os.getpid())
