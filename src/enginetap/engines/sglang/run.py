"""``sglang.Engine`` in this process as enginetap's jobs start and stop it: a clear line
before anything starts (:func:`check_engine`), enginetap's CPU settings
(:func:`start_engine`), and a shutdown that lets the armed scheduler flush
(:func:`stop_engine`). The jobs (``tap run``, ``capture`` with ``--engine sglang``) are in
:mod:`enginetap.jobs`; its traffic driver is
:class:`~enginetap.traffic.drivers.SGLangDriver`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from enginetap.errors import ConfigError

__all__ = ["check_engine", "start_engine", "stop_engine"]


def stop_engine(engine: Any, grace: float = 30.0) -> None:
    """Shut ``engine`` down so that its scheduler processes flush what enginetap armed there.

    ``Engine.shutdown`` ends its processes with SIGKILL: a capture writer in the scheduler
    would lose what it had not written, and its summary. The scheduler processes this
    engine started get SIGTERM first (the capture runtime turns it into an orderly exit
    that flushes the writer and writes the summary), up to ``grace`` seconds; then the
    engine shuts down as usual."""
    import signal
    import time

    import psutil

    schedulers = [p for p in psutil.Process().children(recursive=True)
                  if "scheduler" in " ".join(_names(p))]
    for proc in schedulers:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            continue
    deadline = time.monotonic() + grace
    for proc in schedulers:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except (psutil.TimeoutExpired, psutil.NoSuchProcess):
            continue
    engine.shutdown()


def _names(proc: Any) -> list[str]:
    import psutil

    try:
        return [proc.name(), *proc.cmdline()]
    except psutil.Error:  # it ended meanwhile, or is not ours to read
        return []


def check_engine(model_dir: Path) -> None:
    """One clear line before anything starts: SGLang missing or another version, or a
    model whose architecture enginetap's SGLang path does not cover.

    Raises:
        ConfigError: as said.
    """
    from enginetap.engines.sglang.launch import COVERED, architecture, check_sglang

    check_sglang()
    arch = architecture(model_dir)
    if arch not in COVERED:
        raise ConfigError(f"{arch} is not covered by enginetap on SGLang",
                          f"enginetap's SGLang path covers {', '.join(COVERED)}",
                          "use one of those models, or another engine")


def start_engine(model_dir: Path, *, max_running_requests: int = 8,
                 radix_cache: bool = True, dtype: str = "auto") -> Any:
    """``sglang.Engine`` for ``model_dir`` with enginetap's CPU settings (after
    :func:`check_engine`)."""
    from enginetap.engines.sglang.launch import engine_kwargs

    check_engine(model_dir)
    import sglang

    return sglang.Engine(**engine_kwargs(model_dir, max_running_requests=max_running_requests,
                                         radix_cache=radix_cache, dtype=dtype))
