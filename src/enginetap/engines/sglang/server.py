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

import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from enginetap.config import ARMING_VARS
from enginetap.engines.vllm.server import VLLMServer
from enginetap.errors import EnginetapError, TrafficError
from enginetap.traffic.drivers import Outcome, Submission
from enginetap.traffic.prompts import PromptBuilder

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

    def environment(self) -> dict[str, str]:
        from enginetap.engines.sglang.launch import cpu_environment

        saved = dict(os.environ)
        try:
            cpu_environment()  # SGLANG_USE_CPU_ENGINE and friends where there is no GPU
            env = {k: v for k, v in os.environ.items() if k not in ARMING_VARS}
        finally:
            os.environ.clear()
            os.environ.update(saved)
        env.update(self.extra_env)
        if self.arm is not None:
            config_path = self.log_path.with_name(f"{self.log_path.stem}.arming.json")
            config_path.write_text(self.arm.model_dump_json(indent=2), encoding="utf-8")
            env["ENGINETAP_CONFIG"] = str(config_path)
        return env

    def _failure(self, why: str) -> EnginetapError:
        return EnginetapError(f"SGLang server for {self.model} {why}",
                              f"last lines of {self.log_path}:\n{self.log_tail()}",
                              "read the server log")


class SGLangHTTPDriver:
    """A running SGLang server at ``url`` as a traffic driver.

    Args:
        url: the server's base URL, e.g. ``http://127.0.0.1:30000``.
        max_context: the longest prompt plus output the server takes.
        tokenizer / vocab_size: what prompts are built with (one of them).
        timeout: seconds per HTTP request.
    """

    name = "sglang-http"

    def __init__(self, url: str, *, max_context: int, tokenizer: Any = None,
                 vocab_size: int | None = None, timeout: float = 600.0) -> None:
        self.url, self.max_context = url.rstrip("/"), max_context
        self.tokenizer, self.vocab_size, self.timeout = tokenizer, vocab_size, timeout

    def prompts(self, seed: int) -> PromptBuilder:
        return PromptBuilder(seed, tokenizer=self.tokenizer, vocab_size=self.vocab_size)

    def _post(self, path: str, payload: Mapping[str, Any] | None) -> Any:
        body = b"" if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(f"{self.url}{path}", body,
                                         headers={"Content-Type": "application/json"},
                                         method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                text = reply.read()
        except urllib.error.HTTPError as exc:
            raise TrafficError(f"POST {self.url}{path} failed with HTTP {exc.code}",
                               exc.read().decode(errors="replace")[:500],
                               "check the SGLang server log") from None
        except (urllib.error.URLError, OSError) as exc:
            raise TrafficError(f"POST {self.url}{path} failed", str(exc),
                               "check that the SGLang server is running") from None
        try:
            return json.loads(text or b"null")
        except ValueError:
            return text.decode(errors="replace")

    def reset_prefix_cache(self, attempts: int = 20) -> None:
        for _ in range(attempts):
            try:
                self._post("/flush_cache", None)
                return
            except TrafficError:
                time.sleep(0.25)  # SGLang refuses while requests are running
        raise TrafficError("SGLang did not flush its radix cache",
                           f"it refused {attempts} times", "let running requests finish")

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

    def submit(self, batch: Sequence[Submission]) -> list[Outcome]:
        with ThreadPoolExecutor(max_workers=max(1, len(batch))) as pool:
            return list(pool.map(self._one, batch))
