"""Arming the built-in engine with the same :class:`~enginetap.config.ArmConfig` as vLLM.

The built-in engine publishes every step by itself; its :class:`HFHooks` tell the
capabilities which model was loaded and which of its classes are sublayers. Arming is per
process (as in a vLLM worker): the first engine built in an armed process arms it, later
engines share that arming, and :func:`disarm` removes it.

This is one of the two entry points that resolve the process's config from the
environment (:func:`~enginetap.config.resolve_process_config`: an invalid config is
logged and the engine runs disarmed, unless ``ENGINETAP_STRICT=1``).
"""

from __future__ import annotations

import logging
from typing import Any

from enginetap.capabilities import arm as arm_capabilities
from enginetap.config import ArmConfig, resolve_process_config
from enginetap.core.arming import Arming, setup_logging
from enginetap.core.capability import EngineHooks
from enginetap.core.ranks import rank_world
from enginetap.core.scope import sublayer_targets
from enginetap.engines.hf.targets import SUBLAYERS
from enginetap.errors import ConfigError

logger = logging.getLogger("enginetap.hf")

__all__ = ["HFHooks", "arm", "disarm"]

_ARMED: Arming | None = None


class HFHooks(EngineHooks):
    """The built-in engine: it publishes its own steps; sublayers by class-name suffix."""

    engine = "the built-in transformers engine"

    def sublayer_targets(self, model: Any) -> list[str]:
        return sublayer_targets(model, SUBLAYERS)

    def tap_points(self, model: Any) -> list[tuple[str, Any]]:
        from enginetap.engines.hf.tap import tap_points

        return tap_points(model)

    def capture_probes(self) -> list[Any]:
        from enginetap.engines.hf.probes import PROBES

        return list(PROBES)

    def engine_version(self) -> str:
        import transformers

        return f"transformers {transformers.__version__}"


def arm(config: ArmConfig | None = None) -> Arming | None:
    """Arm this process for the built-in engine; None when ``config`` is not enabled.

    ``config`` defaults to the process's arming (``ENGINETAP_*``, read once).

    Raises:
        ConfigError: the process is already armed with a different config (disarm first),
            or (only with ``ENGINETAP_STRICT=1``) the environment's config is invalid.
            Nothing stays installed on error.
    """
    global _ARMED
    config = resolve_process_config() if config is None else config
    if not config.enabled:
        return None
    if _ARMED is not None:
        if _ARMED.config != config:
            raise ConfigError("this process is already armed with another enginetap config",
                              "arming is per process, like a vLLM worker's",
                              "call enginetap.engines.hf.arming.disarm() first")
        return _ARMED
    rank, world = rank_world()
    _ARMED = arm_capabilities(config, HFHooks(), rank, world)
    setup_logging()
    logger.info("%s", _ARMED.summary())
    return _ARMED


def disarm() -> None:
    """Uninstall what :func:`arm` installed in this process."""
    global _ARMED
    if _ARMED is not None:
        _ARMED.uninstall()
        _ARMED = None
