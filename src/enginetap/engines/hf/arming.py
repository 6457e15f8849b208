"""Arming the built-in engine with the same :class:`~enginetap.config.ArmConfig` as vLLM.

The built-in engine publishes every step by itself, so ``step`` only adds the recorder;
``guard`` installs the configured guard patches in this process. Arming is per process
(as in a vLLM worker): the first engine built in an armed process arms it, later engines
share that arming, and :func:`disarm` removes it.
"""

from __future__ import annotations

import logging

from enginetap.config import ArmConfig, arming
from enginetap.core.arming import Arming, setup_logging
from enginetap.core.ranks import rank_world
from enginetap.errors import ConfigError

logger = logging.getLogger("enginetap.hf")

__all__ = ["arm", "disarm"]

_ARMED: Arming | None = None


def arm(config: ArmConfig | None = None) -> Arming | None:
    """Arm this process for the built-in engine; None when ``config`` is not enabled.

    ``config`` defaults to the process's arming (``ENGINETAP_*``, read once).

    Raises:
        ConfigError: the process is already armed with a different config (disarm first),
            or the config's options are invalid. Nothing stays installed on error.
    """
    global _ARMED
    config = arming() if config is None else config
    if not config.enabled:
        return None
    if _ARMED is not None:
        if _ARMED.config != config:
            raise ConfigError("this process is already armed with another enginetap config",
                              "arming is per process, like a vLLM worker's",
                              "call enginetap.engines.hf.arming.disarm() first")
        return _ARMED
    rank, world = rank_world()
    armed = Arming(config, engine="the built-in transformers engine", rank=rank,
                   world_size=world)
    try:
        armed.install()
    except Exception:
        armed.uninstall()
        raise
    _ARMED = armed
    setup_logging()
    logger.info("%s", armed.summary())
    return armed


def disarm() -> None:
    """Uninstall what :func:`arm` installed in this process."""
    global _ARMED
    if _ARMED is not None:
        _ARMED.uninstall()
        _ARMED = None
