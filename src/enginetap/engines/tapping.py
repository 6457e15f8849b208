"""Tap-point wrappers the serving engines share (vLLM CPU, SGLang): the recurrent and
convolution state of each tapped request around a gated-delta kernel, and the sampler's
logits of each tapped row's request. Each engine says where its call keeps them.

Points are only recorded inside a published step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from enginetap.core.patching import bind_arguments
from enginetap.tap.record import TapRecorder
from enginetap.tap.record.rows import FlatBatch

__all__ = ["StateCall", "logits_wrapper", "state_wrapper"]


@dataclass(slots=True)
class StateCall:
    """What one gated-delta call updates in place, as its engine keeps it."""

    name: str
    """The layer's tap name (``Lk.gdn``)."""
    indices: torch.Tensor
    """Each request's state slot, in the batch's request order (first column if 2-D)."""
    states: Callable[[], Sequence[tuple[str, Any]]]
    """``(label, pool)`` of the state pools (``state``, ``conv``), read at each record."""


def _record(put: Callable[[str, torch.Tensor], None], call: StateCall, slots: torch.Tensor,
            when: str) -> None:
    for label, state in call.states():
        if isinstance(state, torch.Tensor):
            put(f"{call.name}.{label}_{when}", state.index_select(0, slots.to(state.device)))


def state_wrapper(recorder: TapRecorder,
                  read: Callable[[Any, dict[str, Any]], StateCall | None],
                  put: Callable[[str, torch.Tensor], None] | None = None) -> Callable[..., Any]:
    """A wrapper recording ``<name>.state_before/after`` and ``conv_before/after`` of each
    tapped request around the call; ``read(instance, bound arguments)`` says where (None:
    not tapped); ``put(name, rows)`` records one request's rows each (default: the
    recorder's per-request checkpoint; vLLM's compiled model: its tap buffer)."""
    batch = FlatBatch()
    put = put or recorder.checkpoint_requests

    def tap_state(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        if not recorder.options.continuity or not recorder.live:
            return wrapped(*args, **kwargs)
        call = read(instance, bind_arguments(wrapped, args, kwargs))
        requests = batch.read(recorder).of_requests
        if call is None or max(requests) >= call.indices.shape[0]:
            return wrapped(*args, **kwargs)
        slots = call.indices[torch.tensor(requests, dtype=torch.long, device=call.indices.device)]
        if slots.dim() == 2:
            slots = slots[:, 0]
        _record(put, call, slots.to(torch.long), "before")
        out = wrapped(*args, **kwargs)
        _record(put, call, slots.to(torch.long), "after")
        return out

    return tap_state


def logits_wrapper(recorder: TapRecorder,
                   logits_of: Callable[[Any], Any] = lambda out: out) -> Callable[..., Any]:
    """A wrapper noting, once per step, the logits row of each tapped row's request from
    what the call returns (``logits_of``: where the ``[requests, vocab]`` logits are in
    it). Other ranks get no logits and speculative rows are not tapped: a result of
    another shape is not noted."""
    batch = FlatBatch()
    noted: list[Any] = [None]

    def tap_logits(wrapped: Any, _: Any, args: tuple, kwargs: dict) -> Any:
        output = wrapped(*args, **kwargs)
        step = recorder.step if recorder.live else None
        logits = logits_of(output)
        if step is None or noted[0] is step or not isinstance(logits, torch.Tensor) \
                or logits.dim() != 2 or logits.shape[0] != step.extra.get("num_reqs"):
            return output
        noted[0] = step
        rows = torch.tensor(batch.read(recorder).of_rows, dtype=torch.long,
                            device=logits.device)
        recorder.note_logits(logits.index_select(0, rows))
        return output

    return tap_logits
