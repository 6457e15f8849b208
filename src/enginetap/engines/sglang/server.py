"""SGLang's HTTP server as a managed child process.

:class:`SGLangServer` runs ``python -m sglang.launch_server`` with the engine arguments of
:func:`~enginetap.engines.sglang.launch.server_args` in a session of its own (shutting it
down reaches the scheduler and detokenizer), armed explicitly (an
:class:`~enginetap.config.ArmConfig` written beside the log and named by
``ENGINETAP_CONFIG``) or disarmed whatever the caller's environment says: the life cycle
of :class:`~enginetap.engines.vllm.server.VLLMServer`, SGLang's command line.

:class:`~enginetap.traffic.drivers.SGLangHTTPDriver` drives it with a traffic profile.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from enginetap.config import ARMING_VARS
from enginetap.engines.vllm.server import VLLMServer
from enginetap.errors import EnginetapError

__all__ = ["SGLangServer"]


class SGLangServer(VLLMServer):
    """Start, wait for (``/health``), talk to and stop one ``sglang.launch_server``.

    ``args`` default to :func:`~enginetap.engines.sglang.launch.server_args` for the model
    (CPU settings where there is no CUDA device); other arguments as for ``VLLMServer``.
    """

    def __init__(self, model: str | Path, *, args: Sequence[str] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(model, args=(), **kwargs)
        self.args = list(args) if args is not None else None

    def command(self) -> list[str]:
        from enginetap.engines.sglang.launch import server_args

        if self.args is None:  # host 127.0.0.1, as self.host
            args = server_args(self.model, self.port)
        else:
            args = ["--model-path", self.model, "--host", self.host, "--port",
                    str(self.port), *self.args]
        return [sys.executable, "-m", "sglang.launch_server", *args]

    def _engine_environment(self) -> dict[str, str]:
        from enginetap.engines.sglang.launch import cpu_environment

        saved = dict(os.environ)
        try:
            cpu_environment()  # SGLANG_USE_CPU_ENGINE and friends where there is no GPU
            return {k: v for k, v in os.environ.items() if k not in ARMING_VARS}
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def _failure(self, why: str) -> EnginetapError:
        return EnginetapError(f"SGLang server for {self.model} {why}",
                              f"last lines of {self.log_path}:\n{self.log_tail()}",
                              "read the server log")
