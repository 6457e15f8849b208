"""Arming inside vLLM worker processes, triggered by the construction of a model runner.

A process that builds a model runner is a worker: its tensor-parallel group exists and
its model is not loaded yet. That is where the capabilities go:

- ``step``: the V1 runner's step context (:mod:`.runner`), plus the step recorder
  (``options.step.record``, default true) and the tensor-parallel self-check
  (``options.step.selfcheck_gather``, default false);
- ``guard``: each ``"module:function"`` of ``options.guard.patches`` is imported and
  called; it installs its own patches and may return an object with ``uninstall()``;
- ``capture``, ``tap``: not in this version; said so in the log, nothing installed.

Any failure is logged and the worker disarms itself; vLLM goes on serving.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from enginetap.config import ArmConfig, parse_options
from enginetap.core.patching import PatchSet
from enginetap.core.ranks import rank_world, set_group_resolver
from enginetap.engines.vllm.recorder import StepRecorder
from enginetap.engines.vllm.runner import V1_RUNNER, V1_RUNNER_MODULE, V1StepAdapter
from enginetap.guard.options import guard_options, load_install_function

logger = logging.getLogger("enginetap.vllm")

V2_RUNNER = "vllm.v1.worker.gpu.model_runner:GPUModelRunner"

RunnerKind = Literal["v1", "v2"]

__all__ = ["StepOptions", "WorkerArming", "disarm_worker", "runner_triggers", "step_options"]


class StepOptions(BaseModel):
    """``options.step`` of the arming config."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    record: bool = True
    """Write every real step to ``<out_dir>/steps-rank<r>.jsonl``."""
    selfcheck_gather: bool = False
    """After the model loads, gather its sharded weights (see :mod:`.selfcheck`)."""


def step_options(config: ArmConfig) -> StepOptions:
    """Raises: ConfigError: ``options.step`` holds an unknown key or a wrong type."""
    return parse_options(StepOptions, config.options.get("step", {}),
                         "invalid options.step in the enginetap arming config",
                         f"use only {', '.join(StepOptions.model_fields)}")


def runner_triggers(config: ArmConfig) -> PatchSet:
    """Patches that arm the worker when a V1 or V2 model runner is constructed.

    Raises:
        ConfigError: the step or guard options are invalid.
    """
    step_options(config)
    guard_options(config)
    triggers = PatchSet("vllm-runner-triggers")
    if importlib.util.find_spec(V1_RUNNER_MODULE) is None:
        logger.warning("enginetap: this vLLM has no V1 model runner (%s); the step context is "
                       "not available and stays disarmed", V1_RUNNER_MODULE)
    else:
        triggers.add(f"{V1_RUNNER}.__init__", _trigger(config, "v1"))
    triggers.add(f"{V2_RUNNER}.__init__", _trigger(config, "v2"))
    return triggers


def _trigger(config: ArmConfig, kind: RunnerKind):
    def on_runner_init(wrapped: Any, runner: Any, args: tuple, kwargs: dict) -> Any:
        arm_worker(config, kind)
        return wrapped(*args, **kwargs)

    return on_runner_init


def vllm_tp_group() -> Any:
    """vLLM's tensor-parallel device group (raises until vLLM initialized it)."""
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group().device_group


@dataclass
class WorkerArming:
    """What one worker process armed; installed once, uninstalled on any failure."""

    config: ArmConfig
    runner_kind: RunnerKind
    rank: int = 0
    world_size: int = 1
    installed: list[Any] = field(default_factory=list)
    armed: list[str] = field(default_factory=list)
    unavailable: list[str] = field(default_factory=list)

    def install(self) -> None:
        """Raises: ConfigError, PatchError: bad options, or the engine lacks a target."""
        set_group_resolver(vllm_tp_group)
        self.rank, self.world_size = rank_world()
        for capability in self.config.capabilities:
            getattr(self, f"_install_{capability}")()

    def uninstall(self) -> None:
        while self.installed:
            self.installed.pop().uninstall()
        set_group_resolver(None)

    def _install_step(self) -> None:
        if self.runner_kind != "v1":
            self.unavailable.append("step (vLLM's V2 model runner; only V1 is supported)")
            return
        options = step_options(self.config)
        adapter = V1StepAdapter(self.rank, self.world_size, on_failure=disarm_worker)
        self.installed.append(adapter.install())
        what = "step"
        if options.record:
            recorder = StepRecorder(self.config.out_dir, self.rank, self.config.request_filter)
            self.installed.append(recorder.install())
            what += f" (recording to {recorder.path})"
        if options.selfcheck_gather:
            from enginetap.engines.vllm.selfcheck import GatherSelfCheck

            self.installed.append(GatherSelfCheck(self.config.out_dir).install())
            what += " (gather self-check)"
        self.armed.append(what)

    def _install_guard(self) -> None:
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
        text = (f"enginetap armed in vLLM worker pid {os.getpid()} (rank {self.rank} of "
                f"{self.world_size}, {self.runner_kind.upper()} runner): "
                f"{'; '.join(self.armed) or 'nothing'}")
        if self.unavailable:
            text += f"; not available in this version: {', '.join(self.unavailable)}"
        return text


_WORKER: WorkerArming | None = None


def arm_worker(config: ArmConfig, kind: RunnerKind) -> None:
    """Arm this worker process once; on failure log, disarm and let vLLM go on."""
    global _WORKER
    if _WORKER is not None:
        return
    _WORKER = WorkerArming(config, kind)
    try:
        _WORKER.install()
    except Exception:
        logger.exception("enginetap: arming this vLLM worker failed; it runs without enginetap")
        _WORKER.uninstall()
        return
    logger.info("%s", _WORKER.summary())


def disarm_worker() -> None:
    """Uninstall what this worker armed (it is not armed again in this process)."""
    if _WORKER is not None and _WORKER.installed:
        _WORKER.uninstall()
        logger.warning("enginetap: disarmed in vLLM worker pid %d", os.getpid())


def setup_logging() -> None:
    """Make enginetap's INFO lines visible in vLLM's processes, which only configure 'vllm'.

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
