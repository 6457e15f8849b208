"""One step's ledger: what the recording of one step accumulates, in one slotted object.

The recorder (:mod:`.recorder`) makes a new ledger at every step's begin; the checkpointer
(:mod:`.checkpointer`) and the quick steps (:mod:`.quick`) write to it, the step-end
transfer (:mod:`.transfer`) reads it. Nothing in it outlives its step except the names to
examine at their call from the next step on (:attr:`StepLedger.call_later`), which the
recorder hands to the quick steps at the next begin.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from enginetap.core.context import Step

__all__ = ["StepLedger"]


@dataclass(slots=True)
class StepLedger:
    """One step's tapped rows, its checkpoints in order and what they were kept as."""

    pending: Step | None = None
    """The step whose rows are not picked yet (the recorder picks them when first
    needed: a gather, a kernel-level point, step end)."""
    mode: str = ""
    """The step's kind (prefill, decode, mixed)."""
    padded: int = 0
    """The step's token rows, padding included: a tapped tensor's leading rows."""
    rows: list[dict[str, Any]] = field(default_factory=list)
    """The tapped rows' records (see :func:`~.rows.row_records`)."""
    token_index: list[int] = field(default_factory=list)
    request_of_row: list[int] = field(default_factory=list)
    request_token_index: list[int] = field(default_factory=list)
    """Token index of each tapped request's last tapped row (one per request)."""
    names: list[tuple[torch.device, str]] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    """Per name: its slot in its device's staging order (>= 0), or ``-1 - i`` for the
    ``i``-th deferred checkpoint of the step."""
    counts: dict[str, int] = field(default_factory=dict)
    """Calls per checkpoint name this step (repeat counts: ``name#2``...)."""
    sampler: list[tuple[torch.device, torch.Tensor]] = field(default_factory=list)
    index: dict[tuple[str, torch.device], torch.Tensor] = field(default_factory=dict)
    """Per (list, device): the step's row lists as device tensors, built once (or kept
    from the last step where its list was the same: they are only read)."""
    quick: bool = False
    """This step runs quick (its list may already be examined: :attr:`listed` None)."""
    listed: list[tuple[str | None, Any]] | None = None
    """In a quick step, until it is examined: the checkpoints taken so far, in order —
    ``(name, tensor or tuple of outputs)`` to examine at the device wait or step end, or
    ``(None, (device, name, slot))`` for one examined at its call."""
    late_dropped: list[str] = field(default_factory=list)
    """Checkpoints of this quick step that could not be deferred when examined."""
    call_later: set[str] = field(default_factory=set)
    """Checkpoint names (as the wrappers test them) to examine at their call from the next
    step on: gathered rather than deferred, or left out of a quick step."""

    def pick(self, rows: list[dict[str, Any]], previous: StepLedger | None = None) -> None:
        """Take ``rows`` (the tapped rows' records, in batch order) as the step's; the
        ``previous`` step's device lists are kept where this step's lists equal its."""
        self.rows = rows
        self.token_index = [r["token_index"] for r in rows]
        keys = [r["key"] for r in rows]
        if len(set(keys)) == len(keys):  # one row per request (decode)
            self.request_of_row = list(range(len(keys)))
            self.request_token_index = self.token_index
        else:
            last = {key: i for i, key in enumerate(keys)}
            order = {key: n for n, key in enumerate(last)}
            self.request_of_row = [order[key] for key in keys]
            self.request_token_index = [self.token_index[i] for i in last.values()]
        if previous is not None and previous.index:
            mine, theirs = self._lists(), previous._lists()
            self.index.update((key, tensor) for key, tensor in previous.index.items()
                              if mine[key[0]] == theirs[key[0]])

    def carried(self) -> StepLedger:
        """What the next step's :meth:`pick` may keep of this one: its row lists and their
        device tensors only (nothing of its checkpoints)."""
        return StepLedger(token_index=self.token_index, request_of_row=self.request_of_row,
                          request_token_index=self.request_token_index, index=self.index)

    def _lists(self) -> dict[str, list[int]]:
        return {"rows": self.token_index, "requests": self.request_token_index,
                "inverse": self.request_of_row}

    def device_list(self, what: str, device: torch.device) -> torch.Tensor:
        """``"rows"``: :attr:`token_index`, ``"requests"``: :attr:`request_token_index`,
        ``"inverse"``: :attr:`request_of_row`, as an int64 tensor on ``device`` (made once
        per step; the rows must be picked)."""
        found = self.index.get((what, device))
        if found is None:
            found = torch.tensor(self._lists()[what], dtype=torch.int64).to(
                device, non_blocking=True)
            self.index[(what, device)] = found
        return found

    def unique(self, name: str) -> str:
        """``name``, or ``name#2``, ``name#3``... for a module run again in one step."""
        seen = self.counts.get(name, 0) + 1
        self.counts[name] = seen
        return name if seen == 1 else f"{name}#{seen}"

    def record(self, device: torch.device, unique: str, slot: int) -> None:
        """Add checkpoint ``unique`` (its staging or deferred ``slot``) to the step, in
        order: in a quick step not yet examined, among the checkpoints listed."""
        if self.listed is not None:
            self.listed.append((None, (device, unique, slot)))
        else:
            self.names.append((device, unique))
            self.slots.append(slot)

    def row_words(self, tensor: torch.Tensor) -> int:
        """32-bit words per token row of a contiguous ``tensor`` whose leading dims are
        the step's token rows, at a 4-byte aligned address; 0 for any other layout."""
        shape, padded = tensor.shape, self.padded
        nbytes = tensor.nbytes
        if not (shape and (shape[0] == padded or (len(shape) > 1
                                                    and shape[0] * shape[1] == padded))
                and nbytes and not nbytes % (4 * padded) and not tensor.data_ptr() % 4):
            return 0
        return nbytes // padded // 4

    @property
    def deferred_count(self) -> int:
        """Checkpoints of the step hashed in place at step end."""
        return sum(map((0).__gt__, self.slots))  # slot < 0, in C
