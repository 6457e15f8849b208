"""Installing what an :class:`~enginetap.config.ArmConfig` asks for, alike in every engine.

One :class:`Arming` per armed engine process. Each capability installs through one
method; an engine adapter subclasses it and supplies what only the engine knows:
where its steps come from (:meth:`Arming.install_step_source`) and how it names itself.

- ``step``: the engine's step source, plus the step recorder (``options.step.record``,
  default true) writing ``<out_dir>/steps-rank<r>.jsonl``;
- ``guard``: each ``"module:function"`` of ``options.guard.patches`` is imported and
  called; it installs its own patches and may return an object with ``uninstall()``.
  One broken guard patch is logged and skipped: the engine serves its stock path;
- ``capture``, ``tap``: not in this version; listed as unavailable, nothing installed.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from enginetap.config import ArmConfig, parse_options
from enginetap.core.recorder import StepRecorder

logger = logging.getLogger("enginetap.arming")

__all__ = ["Arming", "StepOptions", "setup_logging", "step_options"]


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

    record: bool = True
    """Write every real step to ``<out_dir>/steps-rank<r>.jsonl``."""
    selfcheck_gather: bool = False
    """vLLM only: after the model loads, gather its sharded weights (a TP self-check)."""


def step_options(config: ArmConfig) -> StepOptions:
    """Raises: ConfigError: ``options.step`` holds an unknown key or a wrong type."""
    return parse_options(StepOptions, config.options.get("step", {}),
                         "invalid options.step in the enginetap arming config",
                         f"use only {', '.join(StepOptions.model_fields)}")


@dataclass
class Arming:
    """What one engine process armed; installed once, uninstalled as a whole."""

    config: ArmConfig
    engine: str = "engine"
    rank: int = 0
    world_size: int = 1
    installed: list[Any] = field(default_factory=list)
    armed: list[str] = field(default_factory=list)
    unavailable: list[str] = field(default_factory=list)

    def install(self) -> Arming:
        """Install every capability of the config, in order.

        Raises:
            ConfigError: invalid options. PatchError: the engine lacks a patch target.
            On any error the caller should :meth:`uninstall` what was installed so far.
        """
        for capability in self.config.capabilities:
            getattr(self, f"_install_{capability}")()
        return self

    def uninstall(self) -> None:
        while self.installed:
            self.installed.pop().uninstall()

    def install_step_source(self, options: StepOptions) -> str | None:
        """Make the engine publish its steps; returns what it armed, or None if it cannot.

        The default is an engine that always publishes (the built-in engine).
        """
        return "step"

    def _install_step(self) -> None:
        options = step_options(self.config)
        what = self.install_step_source(options)
        if what is None:
            return
        if options.record:
            recorder = StepRecorder(self.config.out_dir, self.rank, self.config.request_filter)
            self.installed.append(recorder.install())
            what += f" (recording to {recorder.path})"
        self.armed.append(what)

    def _install_guard(self) -> None:
        from enginetap.guard.options import guard_options, load_install_function

        done = []
        for spec in guard_options(self.config).patches:
            try:
                handle = load_install_function(spec)()
            except Exception:  # one broken guard patch must not take the others down
                logger.exception("enginetap: guard patch %s failed; skipped", spec)
                continue
            done.append(spec)
            if callable(getattr(handle, "uninstall", None)):
                self.installed.append(handle)
        self.armed.append(f"guard ({len(done)} patch(es): {', '.join(done) or 'none'})")

    def _install_capture(self) -> None:
        self.unavailable.append("capture")

    def _install_tap(self) -> None:
        self.unavailable.append("tap")

    def summary(self) -> str:
        text = (f"enginetap armed in {self.engine} pid {os.getpid()} (rank {self.rank} of "
                f"{self.world_size}): {'; '.join(self.armed) or 'nothing'}")
        if self.unavailable:
            text += f"; not available in this version: {', '.join(self.unavailable)}"
        return text
