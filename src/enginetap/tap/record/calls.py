"""What engines' kernel-level points and the logits wrappers call on the recorder: the
step's tapped rows, and checkpoints they gather themselves. Each call picks the step's
rows if not done yet and hands the step's ledger to the checkpointer
(:mod:`.checkpointer`); the sublayer wrappers' per-checkpoint call is the recorder's own
:meth:`~.recorder.TapRecorder.take`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from enginetap.core.context import Step
from enginetap.tap.options import TapOptions
from enginetap.tap.record.checkpointer import Checkpointer
from enginetap.tap.record.ledger import StepLedger

__all__ = ["RecorderCalls"]


class RecorderCalls(ABC):
    """The calls of :class:`~.recorder.TapRecorder` that take a step's rows (its base,
    with no state of its own: the step, its ledger and the checkpointer are the
    recorder's, and :meth:`_prepare` is its row picking)."""

    step: Step | None
    ledger: StepLedger
    checkpointer: Checkpointer
    options: TapOptions

    @abstractmethod
    def _prepare(self) -> None:
        """Pick the pending step's rows into the ledger (the recorder's row picking)."""

    @property
    def active(self) -> bool:
        return self.step is not None

    @property
    def live(self) -> bool:
        """Whether this step taps any row (picks the rows if not done yet)."""
        if self.ledger.pending is not None:
            self._prepare()
        return self.step is not None

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The tapped rows' records (picked on first use)."""
        if self.ledger.pending is not None:
            self._prepare()
        return self.ledger.rows

    @property
    def padded(self) -> int:
        """Rows the step's forward computes, padding included."""
        return self.ledger.padded

    @property
    def token_index(self) -> list[int]:
        """The tapped rows' token indices (the rows picked)."""
        return self.ledger.token_index

    @property
    def request_token_index(self) -> list[int]:
        """Token index of each tapped request's last tapped row (the rows picked)."""
        return self.ledger.request_token_index

    @property
    def request_of_row(self) -> list[int]:
        """Each tapped row's request, in :attr:`request_token_index` order."""
        return self.ledger.request_of_row

    def index(self, device: torch.device) -> torch.Tensor:
        """The tapped rows' token indices on ``device`` (built once per step)."""
        if self.ledger.pending is not None:
            self._prepare()
        return self.ledger.device_list("rows", device)

    def request_index(self, device: torch.device) -> torch.Tensor:
        """Token index of each tapped request's last tapped row (one per request)."""
        if self.ledger.pending is not None:
            self._prepare()
        return self.ledger.device_list("requests", device)

    def checkpoint_rows(self, name: str, rows: torch.Tensor) -> None:
        """Stage ``rows`` (one per tapped row, already gathered) under ``name``."""
        if self.live:
            self.checkpointer.hand_over(self.ledger, name, rows, per_request=False)

    def checkpoint_requests(self, name: str, rows: torch.Tensor) -> None:
        """Stage ``rows`` (one per tapped request, in :meth:`request_index` order) under
        ``name``; every tapped row of a request gets its request's hash."""
        if self.live:
            self.checkpointer.hand_over(self.ledger, name, rows, per_request=True)

    def row_slot(self, name: str, dtype: torch.dtype, width: int,
                 device: torch.device) -> torch.Tensor | None:
        """A ``[tapped rows, width]`` staging slot of checkpoint ``name`` for the caller
        to fill (one gather with ``out=``: rows it reads itself, a cache's); None where
        the step taps nothing or the point is refused (see :meth:`.Checkpointer.allowed`)."""
        return self.checkpointer.slot(self.ledger, name, dtype, width, device,
                                      per_request=False) if self.live else None

    def request_slot(self, name: str, dtype: torch.dtype, width: int,
                     device: torch.device) -> torch.Tensor | None:
        """:meth:`row_slot` with one row per tapped request (in :meth:`request_index`
        order): every tapped row of a request gets its request's hash."""
        return self.checkpointer.slot(self.ledger, name, dtype, width, device,
                                      per_request=True) if self.live else None

    def note_logits(self, logits: torch.Tensor) -> None:
        """Top-2 logits of each tapped row (``logits`` is ``[tapped rows, vocab]``)."""
        if self.options.sampler and self.live:
            self.checkpointer.note_logits(self.ledger, logits)
