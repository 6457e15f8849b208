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
from typing import Any

from enginetap.capture.drift import ProbeLock
from enginetap.config import ArmConfig
from enginetap.core.capability import ArmContext, InstallResult
from enginetap.core.patching import PatchSet
from enginetap.core.scope import SublayerSpec
from enginetap.engines.serving import ProcessArming, ServingHooks
from enginetap.engines.sglang.runner import RUNNER, SGLangStepAdapter

logger = logging.getLogger("enginetap.sglang")

SUBLAYERS = SublayerSpec(
    suffixes=("DecoderLayer", "Attention", "AttentionMLA", "MoE", "SparseMoeBlock",
              "GatedDeltaNet", "MLP"),
    classes=("sglang.srt.layers.layernorm:RMSNorm",
             "sglang.srt.layers.moe.fused_moe_triton.layer:FusedMoE",
             "sglang.srt.layers.radix_attention:RadixAttention",
             "sglang.srt.layers.radix_linear_attention:RadixLinearAttention"))

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


class SGLangHooks(ServingHooks):
    """What an SGLang scheduler process supplies: its steps, loaded model, TP group."""

    engine = "SGLang scheduler (model runner)"
    sublayers = SUBLAYERS
    group = staticmethod(sglang_tp_group)

    def install_step_source(self, context: ArmContext) -> InstallResult | None:
        adapter = SGLangStepAdapter(context.rank, context.world_size, on_failure=disarm_worker)
        return adapter.install(), "step"

    def tap_points(self, model: Any) -> list[tuple[str, Any]]:
        from enginetap.engines.sglang.tap import tap_points

        return tap_points(model)

    def engine_version(self) -> str:
        from importlib.metadata import version

        return f"sglang {version('sglang')}"

    def probe_lock(self) -> ProbeLock:
        from enginetap.engines.sglang.probes import LOCK

        return LOCK


_PROCESS = ProcessArming("SGLang process", logger)


def arm_runner(config: ArmConfig, runner: Any) -> ServingHooks | None:
    """Arm this process once (the first model runner that loads); None on failure."""
    return _PROCESS.arm(config, SGLangHooks)


def disarm_worker() -> None:
    """Uninstall what this process armed (it is not armed again in this process)."""
    _PROCESS.disarm()
