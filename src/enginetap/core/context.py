"""The step context: what the engine is running right now, row by row.

Engine adapters publish one :class:`Step` per real engine step (never for dummy, profile
or warm-up runs): its number, prefill/decode/mixed mode, and per token row of the
flattened batch the request id, position and token id, plus the placement metadata the
engine has (query start, computed-token counts, KV slot, recurrent-state slot).

Rows are per token in the engine's own layout. Engines reorder requests between steps, so
consumers must key on ``(request_key, position)``, never on row index across steps.
``request_key`` is stable across runs of the same prompts (vLLM appends a random suffix to
its request ids; the key drops it), ``request_id`` is the engine's own id.

A step ends after the engine sampled its tokens (both engines): end listeners see
``Step.sampled``. :meth:`Step.device_rows` gives the row metadata as device tensors, built
once per step on first use, so GPU consumers never pay a host sync each.

Where a GPU runs the model, an adapter also announces :func:`device_wait` inside the step:
the forward is queued and the host is about to block for its result, so host work its
listeners do there (the records of the step before) costs the step nothing while the
host runs ahead of the device (and as much as anywhere when the step is host-bound).

Capture, tap and guard code reads :func:`current_step` and subscribes to step begin/end
(and wait); it never asks which engine it runs in.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Literal

logger = logging.getLogger("enginetap.context")

Mode = Literal["prefill", "decode", "mixed"]

__all__ = ["Mode", "Step", "StepRows", "abandon", "current_step", "device_wait", "publish",
           "step_number", "subscribe", "unsubscribe"]

_ROW_COLUMNS = ("positions", "token_ids", "query_start", "computed_host", "computed_device",
                "kv_slots", "state_slots", "token_index", "request_keys", "planned_tokens",
                "query_lens", "seq_lens")


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
    """Recurrent-state slot (hybrid models), per row (the first recurrent group's)."""
    token_index: list[int] | None = None
    """The row's index in the model's flattened token tensor (``[batch * columns]`` in a
    padded engine, the row itself in a flat one)."""
    request_keys: list[str] | None = None
    """Run-independent request key per row (None: the request ids are such keys)."""
    kv_groups: dict[str, list[int]] | None = None
    """KV slot per row for every attention cache group, by group name (``kv_slots`` is
    the first group's)."""
    state_groups: dict[str, list[int]] | None = None
    """Recurrent-state slot per row for every recurrent cache group, by group name."""
    planned_tokens: list[int] | None = None
    """Tokens the host scheduler planned for the row's request this step."""
    query_lens: list[int] | None = None
    """Tokens of the row's request in this step as the forward's prepared metadata has
    them (the valid length; None where the engine exposes only the plan)."""
    seq_lens: list[int] | None = None
    """The row's request's sequence length (cached plus this step's tokens) as the
    kernels see it; it must equal ``computed_host + planned_tokens``."""

    def __post_init__(self) -> None:
        n = len(self.request_ids)
        for name in _ROW_COLUMNS:
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"StepRows.{name} has {len(value)} rows, request_ids has {n}")
        for name in ("kv_groups", "state_groups"):
            for group, value in (getattr(self, name) or {}).items():
                if len(value) != n:
                    raise ValueError(f"StepRows.{name}[{group!r}] has {len(value)} rows, "
                                     f"request_ids has {n}")

    @property
    def keys(self) -> list[str]:
        """The request key of every row (the id where the engine's ids are stable)."""
        return self.request_keys if self.request_keys is not None else self.request_ids

    def __len__(self) -> int:
        return len(self.request_ids)

    def rows_of(self, request_id: str) -> list[int]:
        return [i for i, r in enumerate(self.request_ids) if r == request_id]

    def rows_of_key(self, key: str) -> list[int]:
        return [i for i, r in enumerate(self.keys) if r == key]


@dataclass(slots=True)
class Step:
    """One real engine step."""

    engine: str
    step: int
    mode: Mode
    rows: StepRows
    rank: int = 0
    world_size: int = 1
    padded_tokens: int | None = None
    """Tokens the forward really computes, padding included (CUDA-graph style padding,
    left padding of a batch); None where it equals ``len(rows)``."""
    kv_block_size: int | None = None
    """Tokens per KV-cache block (None: the engine has no paged cache)."""
    sampled: dict[str, int] = field(default_factory=dict)
    """Sampled token per request key, filled when the step ends."""
    extra: dict[str, Any] = field(default_factory=dict)
    _device: dict[tuple[str, str], Any] = field(default_factory=dict, repr=False,
                                                compare=False)
    _memo: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)
    _selected_by: list[str] = field(default_factory=list, repr=False, compare=False)

    def select(self, by: str) -> None:
        """Capability ``by`` works on this step (capture: a selected step); a step
        recorder armed with ``options.step.record: "selected"`` writes only such steps."""
        if by not in self._selected_by:
            self._selected_by.append(by)

    @property
    def selected(self) -> bool:
        """Some capability called :meth:`select` for this step."""
        return bool(self._selected_by)

    @staticmethod
    def mode_of(prefill_rows: int, decode_rows: int) -> Mode:
        if prefill_rows and decode_rows:
            return "mixed"
        return "prefill" if prefill_rows else "decode"

    def memo(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()``, computed once per step and ``key`` (what every layer of one step
        derives alike, such as the live columns of a shared attention mask)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def device_rows(self, column: str, device: Any) -> Any:
        """Row column ``column`` (e.g. ``"token_index"``) as an int64 tensor on ``device``,
        built on first use and kept for the rest of the step.

        Raises:
            KeyError: ``column`` is not a row column or the engine does not fill it.
        """
        cache_key = (column, str(device))
        found = self._device.get(cache_key)
        if found is None:
            if column not in _ROW_COLUMNS:
                raise KeyError(f"{column!r} is not a row column ({', '.join(_ROW_COLUMNS)})")
            values = getattr(self.rows, column)
            if values is None:
                raise KeyError(f"this engine does not fill rows.{column}")
            import torch

            found = torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)
            self._device[cache_key] = found
        return found

    def to_json(self) -> dict[str, Any]:
        # Shallow: the row lists go to json as they are (dataclasses.asdict would copy every
        # element, tens of milliseconds on a large prefill).
        rows = {name: getattr(self.rows, name) for name in _ROWS_FIELDS}
        return {name: (rows if name == "rows" else getattr(self, name))
                for name in _STEP_FIELDS}


_ROWS_FIELDS = tuple(f.name for f in fields(StepRows))
_STEP_FIELDS = tuple(f.name for f in fields(Step) if not f.name.startswith("_"))

Listener = Callable[[Step], None]


@dataclass(slots=True)
class _Context:
    step: Step | None = None
    last: int = -1
    on_begin: list[Listener] = field(default_factory=list)
    on_end: list[Listener] = field(default_factory=list)
    on_wait: list[Listener] = field(default_factory=list)


_CTX = _Context()


def current_step() -> Step | None:
    """The step being executed, or None outside a published step."""
    return _CTX.step


def step_number() -> int:
    """The step in flight, else the last published one, else -1 (never decreases)."""
    return _CTX.step.step if _CTX.step is not None else _CTX.last


def subscribe(on_begin: Listener | None = None, on_end: Listener | None = None,
              on_wait: Listener | None = None) -> None:
    """Call ``on_begin`` / ``on_end`` with every published step as it begins / ends, and
    ``on_wait`` where the engine announces :func:`device_wait` in a step."""
    if on_begin is not None:
        _CTX.on_begin.append(on_begin)
    if on_end is not None:
        _CTX.on_end.append(on_end)
    if on_wait is not None:
        _CTX.on_wait.append(on_wait)


def device_wait() -> None:
    """Announced by an engine adapter inside a published step, once the step's forward is
    queued on the device and before the host blocks for its result (the sampled tokens):
    host work its listeners do here overlaps the device's work instead of lengthening the
    step (writing the previous step's records). Engines whose host never waits for a
    device (a CPU engine) do not announce it; listeners must not rely on it coming."""
    step = _CTX.step
    if _CTX.on_wait and step is not None:
        _notify(_CTX.on_wait, step)


def unsubscribe(listener: Listener) -> None:
    for bucket in (_CTX.on_begin, _CTX.on_end, _CTX.on_wait):
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

    ``with publish(step): ...`` makes ``step`` current and notifies begin listeners; on a
    normal exit it notifies end listeners and clears it. A step whose body raised is
    abandoned (cleared without end listeners): it produced no tokens, so it is not real.
    """

    __slots__ = ("_step",)

    def __init__(self, step: Step) -> None:
        self._step = step

    @property
    def step(self) -> Step:
        return self._step

    def __enter__(self) -> Step:
        _CTX.step = self._step
        _CTX.last = max(_CTX.last, self._step.step)
        _notify(_CTX.on_begin, self._step)
        return self._step

    def __exit__(self, exc_type: object = None, *exc: object) -> None:
        if exc_type is not None:
            _CTX.step = None
            return
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
    _CTX.last = -1
    _CTX.on_begin.clear()
    _CTX.on_end.clear()
    _CTX.on_wait.clear()
