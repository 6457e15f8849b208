"""Arming inside SGLang's scheduler processes (one per TP rank), at model loading.

SGLang's scheduler process builds a TP worker whose ``ModelRunner`` initialises the
distributed groups and then loads the model (``ModelRunner.load_model``): that is where
the capabilities go, as :class:`~enginetap.core.arming.Arming` installs them in every
engine. :class:`SGLangHooks` supply the step source (:mod:`.runner`), the loaded model, the
sublayer classes, the kernel-level tap points (:mod:`.tap`), the TP group and the capture
probes (:mod:`.probes`, drift-locked).

Any failure is logged and the process disarms itself; SGLang goes on serving.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from enginetap.capabilities import arm as arm_capabilities
from enginetap.config import ArmConfig
from enginetap.core.arming import Arming
from enginetap.core.capability import ArmContext, EngineHooks, InstallResult
from enginetap.core.patching import PatchSet
from enginetap.core.ranks import rank_world, set_group_resolver
from enginetap.core.scope import SublayerSpec, sublayer_targets
from enginetap.engines.sglang.runner import RUNNER, SGLangStepAdapter

logger = logging.getLogger("enginetap.sglang")

SUBLAYERS = SublayerSpec(
    suffixes=("DecoderLayer", "Attention", "AttentionMLA", "MoE", "SparseMoeBlock",
              "GatedDeltaNet", "MLP"),
    classes=("sglang.srt.layers.layernorm:RMSNorm",
             "sglang.srt.layers.moe.fused_moe_triton.layer:FusedMoE",
             "sglang.srt.layers.radix_attention:RadixAttention",
             "sglang.srt.layers.radix_linear_attention:RadixLinearAttention"))
"""SGLang's sublayers: its model files' decoder/attention/MLP/MoE classes by suffix, and
the shared layer classes by path (a path missing in another SGLang version is skipped)."""

__all__ = ["SUBLAYERS", "SGLangHooks", "arm_runner", "disarm_worker", "runner_triggers"]


def sglang_tp_group() -> Any:
    """SGLang's tensor-parallel device group (raises until SGLang initialised it)."""
    from sglang.srt.distributed.parallel_state import get_tp_group

    return get_tp_group().device_group


def runner_triggers(config: ArmConfig) -> PatchSet:
    """The patch that arms a scheduler process when its model runner loads the model."""
    triggers = PatchSet("sglang-runner-triggers")

    def on_load_model(wrapped: Any, runner: Any, args: tuple, kwargs: dict) -> Any:
        hooks = arm_runner(config, runner)
        result = wrapped(*args, **kwargs)
        if hooks is not None and getattr(runner, "model", None) is not None:
            hooks.model_loaded(runner.model)
        return result

    triggers.add(f"{RUNNER}.load_model", on_load_model)
    return triggers


class SGLangHooks(EngineHooks):
    """What an SGLang scheduler process supplies: its steps, loaded model, TP group."""

    engine = "SGLang scheduler (model runner)"

    def __init__(self) -> None:
        super().__init__()
        self.refused_probes: dict[str, str] = {}

    def install_step_source(self, context: ArmContext) -> InstallResult | None:
        adapter = SGLangStepAdapter(context.rank, context.world_size, on_failure=disarm_worker)
        return adapter.install(), "step"

    def sublayer_targets(self, model: Any) -> list[str]:
        return sublayer_targets(model, SUBLAYERS)

    def tap_points(self, model: Any) -> list[tuple[str, Any]]:
        from enginetap.engines.sglang.tap import tap_points

        return tap_points(model)

    def tp_group(self) -> Any:
        return sglang_tp_group()

    def capture_probes(self) -> list[Any]:
        from enginetap.engines.sglang.probes.lock import checked_probes

        kept, self.refused_probes = checked_probes()
        return kept

    def engine_version(self) -> str:
        from importlib.metadata import version

        return f"sglang {version('sglang')}"


_WORKER: Arming | None = None
_HOOKS: SGLangHooks | None = None


def arm_runner(config: ArmConfig, runner: Any) -> SGLangHooks | None:
    """Arm this process once (the first model runner that loads); None on failure."""
    global _WORKER, _HOOKS
    if _HOOKS is not None:
        return _HOOKS if _WORKER is not None else None
    _HOOKS = SGLangHooks()
    try:
        set_group_resolver(sglang_tp_group)
        rank, world = rank_world()
        _WORKER = arm_capabilities(config, _HOOKS, rank, world)
    except Exception:
        logger.exception("enginetap: arming this SGLang process failed; it runs without "
                         "enginetap")
        set_group_resolver(None)
        return None
    logger.info("%s", _WORKER.summary())
    return _HOOKS


def disarm_worker() -> None:
    """Uninstall what this process armed (it is not armed again in this process)."""
    global _WORKER
    if _WORKER is not None and _WORKER.installed:
        _WORKER.uninstall()
        _WORKER = None
        set_group_resolver(None)
        logger.warning("enginetap: disarmed in SGLang process pid %d", os.getpid())
