"""Arming inside vLLM worker processes, triggered by the construction of a model runner.

A process that builds a model runner is a worker: its tensor-parallel group exists and
its model is not loaded yet. That is where the capabilities go, as
:class:`~enginetap.core.arming.Arming` installs them in every engine; vLLM supplies the
step source (the V1 runner adapter, :mod:`.runner`), the tensor-parallel group, and the
optional TP self-check (``options.step.selfcheck_gather``, default false).

Any failure is logged and the worker disarms itself; vLLM goes on serving.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Any, Literal

from enginetap.config import ArmConfig
from enginetap.core.arming import Arming, StepOptions, step_options
from enginetap.core.patching import PatchSet
from enginetap.core.ranks import rank_world, set_group_resolver
from enginetap.engines.vllm.runner import V1_RUNNER, V1_RUNNER_MODULE, V1StepAdapter
from enginetap.guard.options import guard_options

logger = logging.getLogger("enginetap.vllm")

V2_RUNNER = "vllm.v1.worker.gpu.model_runner:GPUModelRunner"

RunnerKind = Literal["v1", "v2"]

__all__ = ["WorkerArming", "disarm_worker", "runner_triggers"]


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
class WorkerArming(Arming):
    """What one vLLM worker process armed (see :class:`~enginetap.core.arming.Arming`)."""

    runner_kind: RunnerKind = "v1"

    def install(self) -> WorkerArming:
        """Raises: ConfigError, PatchError: bad options, or the engine lacks a target."""
        set_group_resolver(vllm_tp_group)
        self.rank, self.world_size = rank_world()
        self.engine = f"vLLM worker ({self.runner_kind.upper()} runner)"
        super().install()
        return self

    def uninstall(self) -> None:
        super().uninstall()
        set_group_resolver(None)

    def install_step_source(self, options: StepOptions) -> str | None:
        if self.runner_kind != "v1":
            self.unavailable.append("step (vLLM's V2 model runner; only V1 is supported)")
            return None
        adapter = V1StepAdapter(self.rank, self.world_size, on_failure=disarm_worker)
        self.installed.append(adapter.install())
        if not options.selfcheck_gather:
            return "step"
        from enginetap.engines.vllm.selfcheck import GatherSelfCheck

        self.installed.append(GatherSelfCheck(self.config.out_dir).install())
        return "step (gather self-check)"


_WORKER: WorkerArming | None = None


def arm_worker(config: ArmConfig, kind: RunnerKind) -> None:
    """Arm this worker process once; on failure log, disarm and let vLLM go on."""
    global _WORKER
    if _WORKER is not None:
        return
    _WORKER = WorkerArming(config, runner_kind=kind)
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
