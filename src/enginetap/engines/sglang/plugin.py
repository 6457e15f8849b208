"""The ``sglang.srt.plugins`` entry point: SGLang calls :func:`register` in its engine,
scheduler (one per TP rank) and detokenizer processes (``sglang.srt.plugins.load_plugins``).

:func:`register` never raises (SGLang logs a plugin's exception and goes on, but a
half-installed plugin is worse than none), and while the environment does not arm
enginetap and SGLang does not run on the CPU stand-in it only reads ``os.environ``.

- CPU path: where ``SGLANG_USE_CPU_ENGINE`` is set and enginetap's ``sgl_kernel`` stand-in
  is the installed kernel package, the CPU-path fixes (:mod:`.cpu.fixes`) go in, armed or
  not: they make SGLang run there and change nothing it computes.
- Armed (``ENGINETAP=1`` or ``ENGINETAP_CONFIG=...``, see :mod:`enginetap.config`), one
  trigger goes in: the capabilities are installed when a model runner loads its model,
  i.e. in scheduler processes only, after the TP group exists (:mod:`.worker`).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from enginetap.core.patching import PatchSet

logger = logging.getLogger("enginetap.sglang")

__all__ = ["SUPPORTED", "disarm", "register", "uses_cpu_standin"]

SUPPORTED = ("0.5.23",)
"""SGLang versions whose sources the probes and fixes were written against (the drift
lock names what changed in another)."""

_FIXES: list[PatchSet] = []  # the CPU fixes (kept for the process's life)
_TRIGGERS: list[PatchSet] = []  # what this process's arming installed, for disarming


def register() -> None:
    """Install the CPU fixes and arm enginetap in this SGLang process; never raises."""
    try:
        if uses_cpu_standin() and not _FIXES:
            from enginetap.engines.sglang.cpu.fixes import cpu_fixes

            _FIXES.append(cpu_fixes().install())
        from enginetap.config import env_says_armed

        if env_says_armed():
            _arm_process()
    except Exception as exc:
        if _strict() and type(exc).__name__ == "ConfigError":
            raise
        logger.exception("enginetap: arming failed; SGLang continues without enginetap")
        disarm()


def uses_cpu_standin() -> bool:
    """SGLang runs its CPU engine here with enginetap's ``sgl_kernel`` stand-in."""
    if os.environ.get("SGLANG_USE_CPU_ENGINE", "").strip().lower() not in {"1", "true"}:
        return False
    kernel = sys.modules.get("sgl_kernel")
    if kernel is not None:
        return bool(getattr(kernel, "ENGINETAP_CPU_STANDIN", False))
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("enginetap-sgl-kernel-cpu")
    except PackageNotFoundError:
        return False
    return True


def disarm() -> None:
    """Remove what this process's arming installed (the CPU fixes stay: SGLang needs them)."""
    while _TRIGGERS:
        _TRIGGERS.pop().uninstall()
    worker = sys.modules.get("enginetap.engines.sglang.worker")
    if worker is not None:
        worker.disarm_worker()


def _strict() -> bool:
    return os.environ.get("ENGINETAP_STRICT", "").strip().lower() in {"1", "true", "on", "yes"}


def _arm_process() -> None:
    from enginetap.config import resolve_process_config
    from enginetap.core.arming import setup_logging
    from enginetap.engines.sglang.worker import runner_triggers

    setup_logging()
    config = resolve_process_config()
    if not config.enabled:
        return
    if not _TRIGGERS:
        _TRIGGERS.append(runner_triggers(config).install())
    logger.debug("enginetap: armed (pid %d): %s; installs when a model runner loads",
                 os.getpid(), ", ".join(config.capabilities))
