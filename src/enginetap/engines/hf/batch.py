"""Batch layout of the built-in engine: padded inputs, masks, positions and step rows.

One ``generate`` call runs one batch. Every row of the model's cache shares one sequence
axis, so requests are left-padded to line up:

    cache index:  [ 0 .......... P ) [ P .......... P+S ) [ P+S, P+S+1, ...
    row b:        pad  | reused p_b  | pad | prompt suffix | one token per decode step

``P`` is the longest prefix taken from the prefix cache and ``S`` the longest suffix that
prefill computes; pad columns are masked out. Positions (RoPE) count real tokens only.

Step rows, per token the step computes (pads are never rows):

- ``positions``: the token's position in its request (0 = first prompt token).
- ``query_start``: the row index where the request's rows start in this step.
- ``computed_host``: tokens of the request already in the cache before this step (its
  reused prefix in prefill, prompt plus earlier outputs in decode).
- ``kv_slots``: ``slot * capacity + cache_index``: ``slot`` is the request's index in this
  call's batch (kept when finished requests leave the batch), ``capacity`` is
  ``P + S + max_new_tokens``, ``cache_index`` the column above. Unique within a call.
- ``state_slots`` (recurrent models only): the request's ``slot``, the state it updates.
- ``planned_tokens``: the tokens the plan gives the request this step (its suffix in
  prefill, 1 in decode); ``query_lens`` and ``seq_lens`` (:func:`fill_valid_lengths`, when
  the engine is armed): its valid columns in this step's inputs and in the whole attention
  mask, read from the mask the model is given (filled when the step's forward and sampling
  are done, before its end listeners run: reading them earlier would make the host wait
  for the device).

``rows.token_index`` gives each row's flat index into the forward's ``input_ids``
(``row * columns + column``), so a tap can pick the row out of a ``[batch, columns, ...]``
tensor; ``Step.padded_tokens`` is ``batch * columns`` and ``Step.extra["input_shape"]``
the shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from enginetap.core.context import StepRows
from enginetap.engines.hf.prefix import LayerKV
from enginetap.engines.hf.requests import FinishReason, Request

__all__ = ["Plan", "Sequence", "fill_valid_lengths", "plan_decode", "plan_prefill",
           "read_valid_lengths"]


@dataclass(eq=False)
class Sequence:
    """One request's state during a ``generate`` call."""

    request: Request
    slot: int
    prompt: list[int]
    generator: torch.Generator | None
    reused: int = 0
    prefix_kv: LayerKV | None = None
    output: list[int] = field(default_factory=list)
    finish: FinishReason | None = None

    @property
    def suffix(self) -> list[int]:
        return self.prompt[self.reused:]


@dataclass
class Plan:
    """The inputs of one forward and the rows it computes."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    rows: StepRows
    token_index: list[int]


class _Rows:
    """Accumulates step rows column by column."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.pos: list[int] = []
        self.tok: list[int] = []
        self.start: list[int] = []
        self.computed: list[int] = []
        self.kv: list[int] = []
        self.state: list[int] = []
        self.index: list[int] = []
        self.planned: list[int] = []

    def add(self, seq: Sequence, position: int, token: int, start: int, computed: int,
            kv_slot: int, token_index: int, planned: int) -> None:
        self.ids.append(seq.request.request_id)
        self.pos.append(position)
        self.tok.append(token)
        self.start.append(start)
        self.computed.append(computed)
        self.kv.append(kv_slot)
        self.state.append(seq.slot)
        self.index.append(token_index)
        self.planned.append(planned)

    def build(self, recurrent: bool) -> StepRows:
        return StepRows(self.ids, self.pos, self.tok, self.start, self.computed,
                        kv_slots=self.kv, state_slots=self.state if recurrent else None,
                        token_index=self.index, planned_tokens=self.planned)


def read_valid_lengths(mask: torch.Tensor, columns: int) -> torch.Tensor:
    """Per batch row, the valid columns of the attention ``mask`` the model is given in
    this step's inputs (its last ``columns``) and in all: a ``[2, batch]`` host tensor.

    On a GPU the copy to the host is queued without waiting (into pinned memory), so the
    engine's host thread does not stop for the device before the forward; read it with
    :func:`fill_valid_lengths` after the step synchronized (its sampling does)."""
    valid = torch.stack([mask[:, mask.shape[1] - columns:].sum(1), mask.sum(1)])
    if valid.device.type != "cuda":  # the CPU (or a device without pinned copies)
        return valid.cpu()
    host = torch.empty(valid.shape, dtype=valid.dtype, pin_memory=True)
    host.copy_(valid, non_blocking=True)
    return host


def fill_valid_lengths(rows: StepRows, valid: torch.Tensor, columns: int,
                       ready: torch.cuda.Event | None = None) -> None:
    """``rows.query_lens`` and ``rows.seq_lens`` from :func:`read_valid_lengths`
    (``ready``: an event recorded after its copy was queued; waited for first). A row's
    batch row is its token index // columns."""
    if ready is not None:
        ready.synchronize()
    assert rows.token_index is not None
    valid = valid.tolist()
    batch = [i // columns for i in rows.token_index]
    rows.query_lens = [valid[0][b] for b in batch]
    rows.seq_lens = [valid[1][b] for b in batch]


def plan_prefill(seqs: list[Sequence], pad_id: int, capacity: int, recurrent: bool,
                 device: torch.device) -> Plan:
    """Left-padded prefill of every request's uncached prompt suffix."""
    reused = max(s.reused for s in seqs)
    width = max(len(s.suffix) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    positions = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), reused + width), dtype=torch.long)
    rows = _Rows()
    for b, seq in enumerate(seqs):
        n, first = len(seq.suffix), width - len(seq.suffix)
        ids[b, first:] = torch.tensor(seq.suffix)
        positions[b, first:] = torch.arange(seq.reused, seq.reused + n)
        mask[b, reused - seq.reused:reused] = 1
        mask[b, reused + first:] = 1
        start = len(rows.ids)
        for j in range(n):
            column = reused + first + j
            rows.add(seq, seq.reused + j, seq.suffix[j], start, seq.reused,
                     seq.slot * capacity + column, b * width + first + j, n)
    return Plan(ids.to(device), mask.to(device), positions.to(device),
                rows.build(recurrent), rows.index)


def plan_decode(seqs: list[Sequence], mask: torch.Tensor, capacity: int,
                recurrent: bool) -> Plan:
    """One new token per request, appended at cache column ``mask.shape[1]``."""
    column = mask.shape[1]
    rows = _Rows()
    for b, seq in enumerate(seqs):
        position = len(seq.prompt) + len(seq.output) - 1
        rows.add(seq, position, seq.output[-1], b, position,
                 seq.slot * capacity + column, b, 1)
    device = mask.device
    ids = torch.tensor([[s.output[-1]] for s in seqs], dtype=torch.long, device=device)
    positions = torch.tensor([[p] for p in rows.pos], dtype=torch.long, device=device)
    mask = torch.cat([mask, mask.new_ones((len(seqs), 1))], dim=1)
    return Plan(ids, mask, positions, rows.build(recurrent), rows.index)
