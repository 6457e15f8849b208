"""Drivers: send token-id prompts to an engine, a batch at a time, greedily.

Every driver has the :class:`Driver` interface, so capture takes any of them:

- :class:`BuiltinDriver` — the built-in engine (:class:`~enginetap.engines.hf.HFEngine`)
  in this process; a batch is one ``generate`` call.
- :class:`VLLMDriver` — ``vllm.LLM`` in this process; a batch is added to its engine and
  stepped until every request finishes (requests keep our keys as their ids).
- :class:`HTTPDriver` — a running ``vllm serve``; a batch is posted to
  ``/v1/completions`` from a thread pool, each with ``X-Request-Id: <key>``.

Each submission carries a stable request key (``label.index``) that the engine sees in
its request id, so steps can be tied back to a label: the built-in engine uses the key
as is, ``vllm.LLM`` appends ``-<8 hex>``, and ``vllm serve`` names the request
``cmpl-<key>-<choice>-<8 hex>``.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from enginetap.core import context
from enginetap.errors import TrafficError
from enginetap.traffic.prompts import PromptBuilder

__all__ = ["BuiltinDriver", "Driver", "HTTPDriver", "Outcome", "Role", "SGLangDriver",
           "SGLangHTTPDriver", "ServerDriver", "Submission", "VLLMDriver"]

Role = Literal["request", "predecessor", "member", "arrival"]


@dataclass(frozen=True)
class Submission:
    """One prompt to send: its key, label, role and how many tokens to generate."""

    key: str
    label: str
    role: Role
    prompt_ids: list[int]
    max_tokens: int
    source: str | None = None
    """Where the request came from (trace locator), carried into its receipt."""


@dataclass(frozen=True)
class Outcome:
    """What the engine returned for one submission (times from ``time.time()``)."""

    key: str
    output_ids: list[int]
    finish_reason: str | None
    started: float
    finished: float
    cached_tokens: int | None = None
    """Prompt tokens the engine took from its prefix cache (None where it does not say)."""


@runtime_checkable
class Driver(Protocol):
    """What :func:`~enginetap.traffic.runner.run_profile` needs from an engine."""

    name: str
    max_context: int

    def prompts(self, seed: int) -> PromptBuilder:
        """A prompt builder whose token ids are valid for this engine's model."""
        ...

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (between profiles)."""
        ...

    def submit(self, batch: Sequence[Submission]) -> list[Outcome]:
        """Run ``batch`` concurrently, greedy; outcomes in batch order."""
        ...


class BuiltinDriver:
    """The built-in engine in this process.

    The engine has no ``ignore_eos``: a request that samples EOS stops early and its
    receipt says ``finish_reason="stop"``. Cached prompt tokens are read from the step
    context (the ``computed_host`` of each request's first prefill row).
    """

    name = "builtin"

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.max_context: int = engine.max_positions

    def prompts(self, seed: int) -> PromptBuilder:
        return PromptBuilder(seed, tokenizer=self.engine.tokenizer,
                             vocab_size=self.engine.vocab_size)

    def reset_prefix_cache(self) -> None:
        # The engine's prefix cache is its only cross-call state; clearing it is a reset.
        self.engine.prefix_cache.clear()

    def submit(self, batch: Sequence[Submission]) -> list[Outcome]:
        from enginetap.engines.hf.requests import Request

        cached: dict[str, int] = {}

        def on_begin(step: context.Step) -> None:
            if step.mode == "prefill":
                for rid, done in zip(step.rows.request_ids, step.rows.computed_host):
                    cached.setdefault(rid, done)

        requests = [Request(s.key, prompt_ids=s.prompt_ids, max_new_tokens=s.max_tokens)
                    for s in batch]
        context.subscribe(on_begin=on_begin)
        started = time.time()
        try:
            completions = self.engine.generate(requests)
        finally:
            context.unsubscribe(on_begin)
        finished = time.time()
        return [Outcome(c.request_id, c.output_ids, c.finish_reason, started, finished,
                        cached.get(c.request_id)) for c in completions]


class VLLMDriver:
    """``vllm.LLM`` in this process (greedy, ``ignore_eos=True``)."""

    name = "vllm"

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.max_context: int = llm.llm_engine.model_config.max_model_len

    def prompts(self, seed: int) -> PromptBuilder:
        return PromptBuilder(seed, tokenizer=self.llm.get_tokenizer(),
                             vocab_size=self.llm.llm_engine.model_config.get_vocab_size())

    def reset_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise TrafficError("vLLM did not reset its prefix cache",
                               "blocks are still held by running requests",
                               "let running requests finish before the next profile")

    def submit(self, batch: Sequence[Submission]) -> list[Outcome]:
        from vllm import SamplingParams, TokensPrompt

        engine = self.llm.llm_engine
        started = time.time()
        for s in batch:
            params = SamplingParams(temperature=0.0, max_tokens=s.max_tokens, ignore_eos=True)
            engine.add_request(s.key, TokensPrompt(prompt_token_ids=s.prompt_ids), params)
        done: dict[str, Outcome] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    completion = out.outputs[0]
                    done[out.request_id] = Outcome(
                        out.request_id, list(completion.token_ids), completion.finish_reason,
                        started, time.time(), out.num_cached_tokens)
        return [done[s.key] for s in batch]


class ServerDriver(ABC):
    """What the drivers of a running HTTP server share: prompts built with its tokenizer
    (or vocabulary size), JSON POSTs, a batch posted from a thread pool (one request per
    submission, :meth:`_one`) and a cache reset retried while the server refuses it
    (:meth:`_reset_once`). ``url``: the server's base URL; ``timeout``: seconds per request.
    """

    name = "http"
    server = "server"
    """The server in errors ("check that the <server> is running")."""
    http_fix = "check the server log"
    reset_failure = "the server did not reset its prefix cache"

    def __init__(self, url: str, *, tokenizer: Any = None, vocab_size: int | None = None,
                 timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.tokenizer, self.vocab_size, self.timeout = tokenizer, vocab_size, timeout

    def prompts(self, seed: int) -> PromptBuilder:
        return PromptBuilder(seed, tokenizer=self.tokenizer, vocab_size=self.vocab_size)

    def _post(self, path: str, payload: Mapping[str, Any] | None,
              headers: Mapping[str, str] | None = None) -> Any:
        """POST ``payload`` as JSON (None: an empty body); the decoded JSON reply (its text
        when it is not JSON).

        Raises:
            TrafficError: the server answered an HTTP error or could not be reached.
        """
        body = b"" if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(
            f"{self.url}{path}", body, method="POST",
            headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                text = reply.read()
        except urllib.error.HTTPError as exc:
            raise TrafficError(f"POST {self.url}{path} failed with HTTP {exc.code}",
                               exc.read().decode(errors="replace")[:500],
                               self.http_fix) from None
        except (urllib.error.URLError, OSError) as exc:
            raise TrafficError(f"POST {self.url}{path} failed", str(exc),
                               f"check that the {self.server} is running") from None
        try:
            return json.loads(text or b"null")
        except ValueError:
            return text.decode(errors="replace")

    def reset_prefix_cache(self, attempts: int = 20) -> None:
        """Empty the server's prefix cache, retried while running requests hold it.

        Raises:
            TrafficError: the server still refused after ``attempts`` tries.
        """
        for _ in range(attempts):
            if self._reset_once():
                return
            time.sleep(0.25)
        raise TrafficError(self.reset_failure, f"it refused {attempts} times",
                           "let running requests finish")

    @abstractmethod
    def _reset_once(self) -> bool:
        """One reset request; whether the server did it."""

    @abstractmethod
    def _one(self, s: Submission) -> Outcome:
        """Send one submission and wait for its outcome."""

    def submit(self, batch: Sequence[Submission]) -> list[Outcome]:
        with ThreadPoolExecutor(max_workers=max(1, len(batch))) as pool:
            return list(pool.map(self._one, batch))


class HTTPDriver(ServerDriver):
    """A running ``vllm serve`` at ``url`` (needs ``VLLM_SERVER_DEV_MODE=1`` to reset).

    Args:
        url: the server's base URL, e.g. ``http://127.0.0.1:8000``.
        model: the model name the server serves (its ``--model``).
        max_context: the server's ``max_model_len``; default: asked from ``/v1/models``.
        tokenizer / vocab_size: what prompts are built with (one of them).
        timeout: seconds per HTTP request.
    """

    name = "vllm-http"
    http_fix = "check the server log; /reset_prefix_cache needs VLLM_SERVER_DEV_MODE=1"
    reset_failure = "vLLM did not reset its prefix cache"

    def __init__(self, url: str, model: str, *, max_context: int | None = None,
                 tokenizer: Any = None, vocab_size: int | None = None,
                 timeout: float = 600.0) -> None:
        super().__init__(url, tokenizer=tokenizer, vocab_size=vocab_size, timeout=timeout)
        self.model = model
        self.max_context: int = max_context or self._served_max_len()

    @classmethod
    def for_server(cls, server: Any, **kwargs: Any) -> HTTPDriver:
        """A driver for a started :class:`~enginetap.engines.vllm.server.VLLMServer`."""
        return cls(server.url, server.model, **kwargs)

    def _served_max_len(self) -> int:
        """``max_model_len`` of the served model, from ``GET /v1/models``."""
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=30) as reply:
                models = json.loads(reply.read())["data"]
        except (urllib.error.URLError, OSError, KeyError, ValueError) as exc:
            raise TrafficError(f"cannot read the served models from {self.url}/v1/models",
                               str(exc), "check the server, or pass max_context") from None
        for card in models:
            if card.get("id") == self.model and card.get("max_model_len"):
                return int(card["max_model_len"])
        raise TrafficError(f"{self.url} does not list model {self.model!r} with a length",
                           f"it serves {[c.get('id') for c in models]}",
                           "pass the served model name, or max_context")

    def _reset_once(self) -> bool:
        reply = self._post("/reset_prefix_cache", {})
        return not isinstance(reply, dict) or bool(reply.get("success", True))

    def _one(self, s: Submission) -> Outcome:
        started = time.time()
        reply = self._post("/v1/completions", {
            "model": self.model, "prompt": s.prompt_ids, "max_tokens": s.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True},
            headers={"X-Request-Id": s.key})
        choice = reply["choices"][0]
        details = (reply.get("usage") or {}).get("prompt_tokens_details") or {}
        return Outcome(s.key, list(choice.get("token_ids") or []), choice.get("finish_reason"),
                       started, time.time(), details.get("cached_tokens"))


class SGLangHTTPDriver(ServerDriver):
    """A running SGLang server at ``url`` as a traffic driver: SGLang's native
    ``POST /generate`` with token ids (``input_ids``), greedy, the submission's key as the
    request id (``rid``: SGLang keeps it, so the step records name the profile's requests),
    ``POST /flush_cache`` between profiles.

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


class SGLangDriver:
    """``sglang.Engine`` in this process as a traffic driver (greedy, ``ignore_eos``): a
    batch is one ``generate`` call with the submissions' keys as request ids (SGLang keeps
    them, so step records and capture receipts name the profile's requests);
    ``flush_cache`` between profiles."""

    name = "sglang"

    def __init__(self, engine: Any, max_context: int, vocab_size: int) -> None:
        self.engine, self.max_context, self.vocab_size = engine, max_context, vocab_size

    def prompts(self, seed: int) -> Any:
        return PromptBuilder(seed, vocab_size=self.vocab_size)

    def reset_prefix_cache(self, attempts: int = 40) -> None:
        for _ in range(attempts):  # SGLang flushes only once its scheduler is idle
            if getattr(self.engine.flush_cache(), "success", True) is not False:
                return
            time.sleep(0.25)
        raise TrafficError("SGLang did not flush its radix cache",
                           f"its scheduler was busy {attempts} times",
                           "let running requests finish before the next profile")

    def submit(self, batch: Any) -> list[Any]:
        started = time.time()
        params = [{"max_new_tokens": s.max_tokens, "temperature": 0.0, "ignore_eos": True}
                  for s in batch]
        done = self.engine.generate(input_ids=[s.prompt_ids for s in batch],
                                    rid=[s.key for s in batch], sampling_params=params)
        finished = time.time()
        out = []
        for s, d in zip(batch, done):
            meta = d.get("meta_info") or {}
            reason = meta.get("finish_reason")
            out.append(Outcome(s.key, list(d["output_ids"]),
                               reason.get("type") if isinstance(reason, dict) else reason,
                               started, finished, meta.get("cached_tokens")))
        return out
