"""The step context: what the engine is running right now, row by row.

Engine adapters publish one :class:`Step` per real engine step (never for dummy, profile
or warm-up runs): its number, prefill/decode/mixed mode, and per token row of the
flattened batch the request id, position and token id, plus the placement metadata the
engine has (query start, computed-token counts, KV slot, recurrent-state slot).

Rows are per token in the engine's own layout. Engines reorder requests between steps, so
consumers must key on ``(request_id, position)``, never on row index across steps.

Capture, tap and guard code reads :func:`current_step` and subscribes to step begin/end;
it never asks which engine it runs in.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

logger = logging.getLogger("enginetap.context")

Mode = Literal["prefill", "decode", "mixed"]

__all__ = ["Mode", "Step", "StepRows", "abandon", "current_step", "publish", "subscribe",
           "unsubscribe"]


@dataclass(slots=True)
class StepRows:
    """Per token-row metadata, all lists of equal length (the flattened batch)."""

    request_ids: list[str]
    positions: list[int]
    token_ids: list[int]
    query_start: list[int]
    """Row index where this row's request starts in the flattened batch."""
    computed_host: list[int]
    """The request's computed-token count before this step, as the host scheduler has it."""
    computed_device: list[int] | None = None
    """The same count as the device-side state has it (None where the engine keeps none)."""
    kv_slots: list[int] | None = None
    """Flat KV-cache slot the row's key/value is written to."""
    state_slots: list[int] | None = None
    """Recurrent-state slot (hybrid models), per row."""

    def __post_init__(self) -> None:
        n = len(self.request_ids)
        for name in ("positions", "token_ids", "query_start", "computed_host",
                     "computed_device", "kv_slots", "state_slots"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"StepRows.{name} has {len(value)} rows, request_ids has {n}")

    def __len__(self) -> int:
        return len(self.request_ids)

    def rows_of(self, request_id: str) -> list[int]:
        return [i for i, r in enumerate(self.request_ids) if r == request_id]


@dataclass(slots=True)
class Step:
    """One real engine step."""

    engine: str
    step: int
    mode: Mode
    rows: StepRows
    rank: int = 0
    world_size: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def mode_of(prefill_rows: int, decode_rows: int) -> Mode:
        if prefill_rows and decode_rows:
            return "mixed"
        return "prefill" if prefill_rows else "decode"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


Listener = Callable[[Step], None]


@dataclass(slots=True)
class _Context:
    step: Step | None = None
    on_begin: list[Listener] = field(default_factory=list)
    on_end: list[Listener] = field(default_factory=list)


_CTX = _Context()


def current_step() -> Step | None:
    """The step being executed, or None outside a published step."""
    return _CTX.step


def subscribe(on_begin: Listener | None = None, on_end: Listener | None = None) -> None:
    if on_begin is not None:
        _CTX.on_begin.append(on_begin)
    if on_end is not None:
        _CTX.on_end.append(on_end)


def unsubscribe(listener: Listener) -> None:
    for bucket in (_CTX.on_begin, _CTX.on_end):
        while listener in bucket:
            bucket.remove(listener)


def _notify(listeners: list[Listener], step: Step) -> None:
    for listener in list(listeners):
        try:
            listener(step)
        except Exception:  # a consumer's bug must not break the engine's step
            logger.exception("enginetap: step listener %r failed", listener)


class publish:
    """Context manager an engine adapter wraps around one real step.

    ``with publish(step): ...`` makes ``step`` current, notifies begin listeners, and on
    exit notifies end listeners and clears it (also when the step raised).
    """

    __slots__ = ("_step",)

    def __init__(self, step: Step) -> None:
        self._step = step

    def __enter__(self) -> Step:
        _CTX.step = self._step
        _notify(_CTX.on_begin, self._step)
        return self._step

    def __exit__(self, *exc: object) -> None:
        try:
            _notify(_CTX.on_end, self._step)
        finally:
            _CTX.step = None


def abandon() -> None:
    """Drop the current step without notifying end listeners.

    For adapters that learn only after a step began that it was not a real step (the
    engine raised, or nothing was sampled): consumers never see it end.
    """
    _CTX.step = None


def reset() -> None:
    """Drop the current step and every listener (tests, re-arming)."""
    _CTX.step = None
    _CTX.on_begin.clear()
    _CTX.on_end.clear()
