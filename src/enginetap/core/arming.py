"""Installing what an arming config asks for, alike in every engine.

One :class:`Arming` per armed engine process. It installs the config's capabilities in
the registry's order, each through its own install function handed one
:class:`~enginetap.core.capability.ArmContext`, and uninstalls them as a whole. What only
the engine knows (where its steps come from, which model it loaded, its TP group) comes
from the engine adapter's :class:`~enginetap.core.capability.EngineHooks`; nothing here
subclasses per engine or reads the environment.

``step`` is core's own capability (:data:`STEP`): the engine's step source, plus the step
recorder (``options.step.record``, default true) writing ``<out_dir>/steps-rank<r>.jsonl``.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from enginetap.core.capability import (ArmContext, ArmSpec, Capability, CapabilityRegistry,
                                       EngineHooks, InstalledGroup, InstallResult,
                                       set_current_arming)
from enginetap.core.recorder import StepRecorder

logger = logging.getLogger("enginetap.arming")

__all__ = ["STEP", "Arming", "StepOptions", "setup_logging"]


def setup_logging() -> None:
    """Make enginetap's INFO lines visible: engines such as vLLM configure only their own.

    Records still propagate, so a host that configured the root logger sees them too.
    """
    ours = logging.getLogger("enginetap")
    if ours.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [enginetap] %(message)s",
                                           "%m-%d %H:%M:%S"))
    ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.INFO)


class StepOptions(BaseModel):
    """``options.step`` of the arming config."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    record: bool | Literal["selected"] = True
    """Write every real step to ``<out_dir>/steps-rank<r>.jsonl``; ``"selected"``: only
    the steps a capability selected (capture's selected steps; what ``enginetap capture``
    arms: a line costs the engine's thread about 0.1 ms on a GPU host, BENCHMARKS.md);
    false: none."""
    selfcheck_gather: bool = False
    """vLLM only: after the model loads, gather its sharded weights (a TP self-check)."""


def install_step(context: ArmContext) -> InstallResult:
    """The ``step`` capability: the engine's step source plus the recorder."""
    options = context.options_of("step")
    assert isinstance(options, StepOptions)
    source = context.hooks.install_step_source(context)
    if source is None:
        context.notes["steps"] = False
        return None, "step (unavailable in this engine)"
    installed, what = source
    parts = [installed] if installed is not None else []
    if options.record:
        recorder = StepRecorder(context.out_dir, context.rank, context.config.request_filter,
                                only_selected=options.record == "selected")
        parts.append(recorder.install())
        context.notes["step_recorder"] = recorder
        what += f" (recording to {recorder.path})"
    context.notes["steps"] = True
    return InstalledGroup(parts), what


STEP = Capability("step", StepOptions, install_step,
                  "the step context (rows, modes, slots) and its recorder", needs=())


@dataclass
class Arming:
    """What one engine process armed; installed once, uninstalled as a whole.

    ``options`` are the config's validated options (``ArmConfig.parsed_options()``);
    while installed, :func:`~enginetap.core.capability.current_arming` returns its context.
    """

    config: ArmSpec
    registry: CapabilityRegistry
    options: dict[str, BaseModel]
    hooks: EngineHooks = field(default_factory=EngineHooks)
    rank: int = 0
    world_size: int = 1
    installed: list[Any] = field(default_factory=list)
    armed: list[str] = field(default_factory=list)
    context: ArmContext | None = None

    def install(self) -> Arming:
        """Install every capability of the config, in registry order.

        Raises:
            ConfigError: an unknown capability. PatchError: the engine lacks a patch
            target. Whatever an install function raises. On any error everything
            installed so far is uninstalled before the error propagates.
        """
        names = self.registry.order(self.config.capabilities)
        dependents = {n: [m for m in names if n in self.registry.get(m).needs] for n in names}
        users = dependents.get("scope", [])  # none: the scope armed by itself
        running = not users or any(self.registry.get(m).running_scope for m in users)
        self.context = ArmContext(self.config, names, self.options, self.hooks,
                                  self.rank, self.world_size, dependents=dependents,
                                  running_scope=running)
        set_current_arming(self.context)
        try:
            for name in names:
                if name != "step" and self.context.notes.get("steps") is False:
                    self.armed.append(f"{name} (needs the step context: not armed)")
                    continue
                handle, what = self.registry.get(name).install_function()(self.context)
                if handle is not None:
                    self.installed.append(handle)
                self.armed.append(what)
        except BaseException:
            self.uninstall()
            raise
        return self

    def uninstall(self) -> None:
        while self.installed:
            self.installed.pop().uninstall()
        set_current_arming(None)

    def summary(self) -> str:
        return (f"enginetap armed in {self.hooks.engine} pid {os.getpid()} (rank {self.rank} "
                f"of {self.world_size}): {'; '.join(self.armed) or 'nothing'}")
