"""SGLang's HTTP server as a managed child process, and a traffic driver for it.

:class:`SGLangServer` runs ``python -m sglang.launch_server`` with the engine arguments of
:func:`~enginetap.engines.sglang.launch.server_args` in a session of its own (shutting it
down reaches the scheduler and detokenizer), armed explicitly (an
:class:`~enginetap.config.ArmConfig` written beside the log and named by
``ENGINETAP_CONFIG``) or disarmed whatever the caller's environment says: the life cycle
of :class:`~enginetap.engines.vllm.server.VLLMServer`, SGLang's command line.

:class:`SGLangHTTPDriver` drives it with a traffic profile (Mooncake, AgentX):
SGLang's native ``POST /generate`` with token ids (``input_ids``), greedy, the
submission's key as the request id (``rid``: SGLang keeps it, so the step records name
the profile's requests), ``POST /flush_cache`` between profiles.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from enginetap.config import ARMING_VARS
from enginetap.engines.vllm.server import VLLMServer
from enginetap.errors import EnginetapError, TrafficError
from enginetap.traffic.drivers import Outcome, ServerDriver, Submission

__all__ = ["SGLangHTTPDriver", "SGLangServer"]


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


class SGLangHTTPDriver(ServerDriver):
    """A running SGLang server at ``url`` as a traffic driver.

    Args:
        url: the server's base URL, e.g. ``http://127.0.0.1:30000``.
        max_context: the longest prompt plus output the server takes.
        tokenizer / vocab_size: what prompts are built with (one of them).
        timeout: seconds per HTTP request.
    """

    name = "sglang-http"
    server = "SGLang server"
    http_fix = "check the SGLang server log"
    reset_failure = "SGLang did not flush its radix cache"

    def __init__(self, url: str, *, max_context: int, tokenizer: Any = None,
                 vocab_size: int | None = None, timeout: float = 600.0) -> None:
        super().__init__(url, tokenizer=tokenizer, vocab_size=vocab_size, timeout=timeout)
        self.max_context = max_context

    def _reset_once(self) -> bool:
        try:
            self._post("/flush_cache", None)
        except TrafficError:  # SGLang refuses while requests are running
            return False
        return True

    def _one(self, s: Submission) -> Outcome:
        started = time.time()
        reply = self._post("/generate", {
            "input_ids": s.prompt_ids, "rid": s.key,
            "sampling_params": {"max_new_tokens": s.max_tokens, "temperature": 0.0,
                                "ignore_eos": True}})
        meta = reply.get("meta_info") or {}
        reason = meta.get("finish_reason")
        return Outcome(s.key, list(reply.get("output_ids") or []),
                       reason.get("type") if isinstance(reason, dict) else reason,
                       started, time.time(), meta.get("cached_tokens"))
