"""What a caller asks the built-in engine for, what it gets back, and the input checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from enginetap.errors import ConfigError

__all__ = ["Completion", "FinishReason", "Request", "prompt_ids_of"]

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Request:
    """One generation request: a prompt as token ids or as text, and how to sample.

    ``temperature == 0`` is greedy. With ``temperature > 0`` the request draws from its own
    generator seeded with ``seed`` (a random seed when None), so its tokens do not depend on
    the requests batched with it.
    """

    request_id: str
    prompt_ids: list[int] | None = None
    prompt: str | None = None
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


@dataclass(frozen=True)
class Completion:
    """The result of one request; ``output_ids`` ends with EOS when ``finish_reason`` is stop."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: FinishReason


def _bad(request: Request, why: str, fix: str) -> ConfigError:
    return ConfigError(f"bad request {request.request_id!r}", why, fix)


def _check_sampling(request: Request) -> None:
    if request.max_new_tokens < 1:
        raise _bad(request, f"max_new_tokens is {request.max_new_tokens}", "ask for ≥ 1 token")
    if request.temperature < 0:
        raise _bad(request, f"temperature is {request.temperature}", "use 0 (greedy) or > 0")
    if not 0 < request.top_p <= 1:
        raise _bad(request, f"top_p is {request.top_p}", "use a value in (0, 1]")


def prompt_ids_of(request: Request, tokenizer: Any, vocab_size: int,
                  max_positions: int) -> list[int]:
    """The request's prompt as token ids, checked against the model.

    Raises:
        ConfigError: neither or both of ``prompt_ids``/``prompt`` given, an empty prompt,
            text without a tokenizer, ids outside the vocabulary, bad sampling values, or
            prompt plus ``max_new_tokens`` longer than the model's maximum positions.
    """
    _check_sampling(request)
    if (request.prompt_ids is None) == (request.prompt is None):
        raise _bad(request, "it must carry exactly one of prompt_ids and prompt",
                   "pass token ids or text, not both")
    if request.prompt is not None:
        if tokenizer is None:
            raise _bad(request, "the model folder has no tokenizer", "pass prompt_ids instead")
        ids = list(tokenizer(request.prompt)["input_ids"])
    else:
        ids = [int(t) for t in request.prompt_ids or []]
    if not ids or (request.prompt is not None and not request.prompt):
        raise _bad(request, "its prompt is empty", "give at least one prompt token")
    if any(not 0 <= t < vocab_size for t in ids):
        raise _bad(request, f"a prompt id is outside the vocabulary [0, {vocab_size})",
                   "encode the prompt with this model's tokenizer")
    if len(ids) + request.max_new_tokens > max_positions:
        raise _bad(request, f"{len(ids)} prompt + {request.max_new_tokens} new tokens exceed "
                   f"the model's {max_positions} positions",
                   "shorten the prompt or lower max_new_tokens")
    return ids
