"""The ``vllm.general_plugins`` entry point: vLLM calls :func:`register` in every process.

vLLM loads general plugins once in each of its processes (the API server or ``LLM`` owner,
the engine core, every worker) before any model is built, and does not catch what the
plugin function raises. So :func:`register` never raises, and while the environment does
not arm enginetap it only reads ``os.environ`` (plus the AMX request below).

Armed (``ENGINETAP=1`` or ``ENGINETAP_CONFIG=...``, see :mod:`enginetap.config`), it
installs one trigger per model-runner kind. The capabilities themselves are installed
when a model runner is constructed, i.e. in worker processes only, after the
tensor-parallel group exists and before the model is loaded (see :mod:`.worker`).

AMX: on x86 CPUs with AMX, Linux lets a process run AMX instructions only after it asks;
vLLM CPU's kernels use AMX where the CPU has it, and a server worker that never asked dies
with SIGILL. :func:`register` asks, armed or not (``ENGINETAP_AMX=0`` opts out), when
torch is already imported: the request changes no result, and doing it whether or not
enginetap is armed keeps armed and disarmed engines on the same kernels.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from enginetap.core.patching import PatchSet

logger = logging.getLogger("enginetap.vllm")

__all__ = ["disarm", "register"]

_TRIGGERS: list[PatchSet] = []  # what this process's arming installed, for disarming


def register() -> None:
    """Arm enginetap in this vLLM process if the environment asks; never raises."""
    try:
        _request_amx()
        from enginetap.config import env_says_armed

        if env_says_armed():
            _arm_process()
    except Exception as exc:  # vLLM does not catch plugin errors: report, disarm, let it serve
        if _strict() and type(exc).__name__ == "ConfigError":
            raise  # ENGINETAP_STRICT=1: the user asked for a bad config to stop vLLM
        logger.exception("enginetap: arming failed; vLLM continues without enginetap")
        disarm()


def disarm() -> None:
    """Remove every patch this process installed (triggers and worker capabilities)."""
    while _TRIGGERS:
        _TRIGGERS.pop().uninstall()
    worker = sys.modules.get("enginetap.engines.vllm.worker")  # imported only when armed
    if worker is not None:
        worker.disarm_worker()


def _strict() -> bool:
    return os.environ.get("ENGINETAP_STRICT", "").strip().lower() in {"1", "true", "on", "yes"}


def _request_amx() -> None:
    if os.environ.get("ENGINETAP_AMX", "1").strip().lower() in {"0", "false", "off", "no"}:
        return
    torch = sys.modules.get("torch")  # never import torch here: disarmed must stay free
    init_amx = getattr(getattr(getattr(torch, "_C", None), "_cpu", None), "_init_amx", None)
    if init_amx is not None:
        init_amx()


def _arm_process() -> None:
    from enginetap.config import resolve_process_config
    from enginetap.core.arming import setup_logging
    from enginetap.engines.vllm.worker import runner_triggers

    setup_logging()
    config = resolve_process_config()
    if not config.enabled:
        return
    triggers = runner_triggers(config)
    _TRIGGERS.append(triggers.install())
    logger.debug("enginetap: armed (pid %d): %s; installs in worker processes",
                 os.getpid(), ", ".join(config.capabilities))
