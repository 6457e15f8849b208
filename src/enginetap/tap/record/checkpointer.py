"""Checkpoints: where the tapped rows of each checkpoint go during a step.

A checkpoint (:meth:`Checkpointer.take`) is kept for the step-end hash in place
(deferred, :mod:`enginetap.tap.record.deferred`) where the device allows, else its
tapped rows are gathered into the step's staging buffer
(:class:`~enginetap.tap.record.staging.StepStaging`); engines' kernel-level points fill a
staging slot themselves (:meth:`Checkpointer.slot`) or hand rows over
(:meth:`Checkpointer.hand_over`). The checkpointer owns every device's staging buffer and
deferred state, kept step after step; each checkpoint is added to the step's ledger
(:class:`~enginetap.tap.record.ledger.StepLedger`), in order.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import torch

from enginetap.core.rowsplit import join_rows
from enginetap.tap.options import TapOptions
from enginetap.tap.record.fingerprint import token_rows
from enginetap.tap.record.deferred import DeferredHashes
from enginetap.tap.record.ledger import StepLedger
from enginetap.tap.record.staging import StepStaging

logger = logging.getLogger("enginetap.tap")

__all__ = ["Checkpointer", "call_key", "outputs_of"]

# Bound once: read on every checkpoint.
_Tensor = torch.Tensor
_compiling = torch.compiler.is_compiling
_capturing = torch.cuda.is_current_stream_capturing


class Checkpointer:
    """Checkpoint routing: every device's staging buffer and deferred state.

    ``pick``: picks the step's tapped rows into its ledger (the recorder's, called where
    a checkpoint needs them and they are not picked yet)."""

    __slots__ = ("options", "staging", "deferred", "fast", "defer", "forced", "cuda",
                 "refused", "pick", "step")

    def __init__(self, options: TapOptions, pick: Callable[[], None]) -> None:
        self.options = options
        self.pick = pick
        self.staging: dict[torch.device, StepStaging] = {}
        self.deferred: dict[torch.device, DeferredHashes | None] = {}
        """By device: its deferred state, None where the device does not defer."""
        self.fast: dict[int, DeferredHashes] = {}
        """The devices whose checkpoints are deferred, by ``Tensor.get_device()`` index
        (the checkpoint's fast path: no ``torch.device`` made per call)."""
        self.defer = options.defer and options.vectors == "off"
        self.forced = options.force
        self.cuda = torch.cuda.is_available()
        self.refused: set[str] = set()
        self.step: tuple[str, int] = ("", 1)
        """The current step's kind and number (a device's deferred state starts there)."""

    def start(self, mode: str, number: int) -> None:
        """Step number ``number`` of kind ``mode`` begins."""
        self.step = (mode, number)
        for deferred in self.deferred.values():
            if deferred is not None:
                deferred.reset(mode, number)

    def rows_picked(self, ledger: StepLedger) -> None:
        """The step's rows are picked: every device's staging buffer starts the step."""
        for device, staging in self.staging.items():
            staging.reset(len(ledger.rows), ledger.device_list("inverse", device))

    def hashed_bytes(self) -> int:
        """Bytes staged and hashed in place in the step just ended."""
        return sum(s.used for s in self.staging.values()) + sum(
            d.hashed_bytes for d in self.deferred.values() if d is not None)

    def allowed(self, name: str) -> bool:
        """False (and noted once) inside compile tracing or graph capture unless forced."""
        return self.forced or not (_compiling() or (self.cuda and _capturing())) \
            or self._refuse(name)

    def _refuse(self, name: str) -> bool:
        if name not in self.refused:
            self.refused.add(name)
            logger.warning("tap: %s not recorded under torch.compile / CUDA-graph capture "
                           "(hooks would be traced into the graph; set options.tap.force)",
                           name)
        return False

    def take(self, ledger: StepLedger, name: str, tensor: Any) -> None:
        """Stage the tapped rows of ``tensor`` (a token-major tensor of the step's
        forward) under ``name``; tensors of another layout are skipped. Runs once per
        checkpoint, hundreds of times per step: the usual case (a contiguous tensor on a
        device whose checkpoints are deferred) is a few attribute reads and a kept
        reference, with no tensor object made; the rest takes :meth:`_checkpoint`."""
        # allowed(), inlined, and first: under compile tracing nothing else may run here
        if not isinstance(tensor, _Tensor) or not (
                self.forced or not (_compiling() or (self.cuda and _capturing()))
                or self._refuse(name)):
            return
        fast = self.fast
        deferred = fast.get(tensor.get_device()) if fast else None
        if deferred is None or tensor.requires_grad or not tensor.is_contiguous():
            self._checkpoint(ledger, name, tensor)
            return
        words = ledger.row_words(tensor)
        if not words:
            self._checkpoint(ledger, name, tensor)
            return
        unique = ledger.unique(name)
        slot = deferred.keep(unique, tensor, words, tensor.nbytes)
        if slot >= 0 and not deferred.needs_check(unique):
            ledger.record(deferred.device, unique, -1 - slot)
            return
        source = token_rows(tensor, ledger.padded)
        assert source is not None  # the row layout was checked above
        self._stage_named(ledger, unique, source, slot, deferred)

    def _checkpoint(self, ledger: StepLedger, name: str, tensor: torch.Tensor) -> None:
        """:meth:`take` (past :meth:`allowed`) for what its fast path does not
        take (non-contiguous or grad-tracking tensors, row shards of a sequence-parallel
        forward): a view of the rows, deferred where the device allows, else gathered."""
        if tensor.requires_grad:  # only outside inference mode; a view costs little
            tensor = tensor.detach()
        padded = ledger.padded
        source = token_rows(tensor, padded)
        if source is None:
            # A row shard of a sequence-parallel forward: fingerprint every rank's rows.
            joined = join_rows(tensor, padded)
            source = None if joined is None else token_rows(joined, padded)
        if source is None:
            return
        device = source.device
        unique = ledger.unique(name)
        check, deferred = -1, None
        if self.defer:
            deferred = self.deferred.get(device, False)
            if deferred is False:
                deferred = self._deferred_for(source)
            if deferred is not None and deferred.accepts(unique, source):
                check = deferred.add(unique, source)
                if not deferred.needs_check(unique):
                    ledger.record(device, unique, -1 - check)
                    return
        self._stage_named(ledger, unique, source, check, deferred)

    def keep_cache(self, ledger: StepLedger, names: tuple[str, ...], keys: torch.Tensor,
                   values: torch.Tensor, columns: tuple[int, ...]
                   ) -> list[tuple[int, torch.Tensor]]:
        """Checkpoints ``names``: each its column (``columns``) of batch rows ``0..k-1`` of
        a ``[batch, heads, length, dim]`` key and value cache pair, where the step's ``k``
        tapped rows are its ``k`` token rows, one per batch row (a decode step; the layout
        checked with :func:`~enginetap.tap.record.deferred.cache_layout`), kept to hash in
        place at step end (:meth:`.DeferredHashes.keep_cache`): no torch call. Returns,
        for the names not only so kept, their place in ``names`` and a ``[k, 2 * heads *
        dim]`` staging slot for the caller to fill with the gathered rows (every head's
        key, then every head's value): in a verification step, where the two hashes are
        compared, or where the name was demoted or the byte budget is spent. Nothing
        where the points are refused (see :meth:`allowed`). Taken at the call even in a
        quick step (markers in its list, see :meth:`.StepLedger.record`)."""
        if not all([self.allowed(name) for name in names]):  # each refused name noted
            return []
        device = keys.device
        deferred = self.fast.get(keys.get_device())
        if deferred is None and self.defer and device not in self.deferred:
            deferred = self._deferred_for(keys)
        uniques = [ledger.unique(name) for name in names]
        slots = [-1] * len(names) if deferred is None else \
            deferred.keep_cache(uniques, keys, values, columns, len(ledger.rows))
        fill: list[tuple[int, torch.Tensor]] = []
        for i, (unique, slot) in enumerate(zip(uniques, slots)):
            if slot >= 0 and deferred is not None and not deferred.needs_check(unique):
                ledger.record(device, unique, -1 - slot)
                continue
            staging = self.staging.get(device) or self.staging_for(ledger, device)
            fill.append((i, staging.slot(keys.dtype, 2 * keys.shape[1] * keys.shape[3])))
            staged = len(staging.order) - 1
            if slot >= 0 and deferred is not None:
                deferred.checks.append((unique, staged, slot))
            ledger.record(device, unique, staged)
        return fill

    def _stage_named(self, ledger: StepLedger, unique: str, source: torch.Tensor,
                     check: int, deferred: DeferredHashes | None) -> None:
        """Gather ``source``'s tapped rows under ``unique``; with ``check`` >= 0 the same
        checkpoint is also deferred (slot ``check``) and the two hashes are compared."""
        if ledger.pending is not None:
            self.pick()
            if not ledger.rows:
                return
        slot = self._stage(ledger, source)
        if check >= 0 and deferred is not None:
            deferred.checks.append((unique, slot, check))
        elif self.fast and not (deferred is not None and deferred.spent):
            # gathered, not deferred: examined at its call in quick steps (not where only
            # this step's byte budget was spent: a long prefill's size says nothing about
            # the name, and its decode steps would all be examined at the call)
            ledger.call_later.add(call_key(unique))
        ledger.record(source.device, unique, slot)

    def _stage(self, ledger: StepLedger, source: torch.Tensor) -> int:
        """Gather the tapped rows of ``source`` into a staging slot; the slot's place in
        its device's staging order."""
        device = source.device
        staging = self.staging.get(device) or self.staging_for(ledger, device)
        index = ledger.index.get(("rows", device))
        staging.stage(source, ledger.device_list("rows", device) if index is None else index)
        return len(staging.order) - 1

    def _deferred_for(self, source: torch.Tensor) -> DeferredHashes | None:
        from enginetap.tap.record import kernels

        found = None
        if kernels.available(source):
            found = DeferredHashes(source.device, self.options.defer_bytes,
                                   verify_every=self.options.defer_verify_every,
                                   lag=int(source.device.type == "cuda"
                                           and self.options.vectors == "off"))
            found.reset(*self.step)
        self.deferred[source.device] = found
        if found is not None:
            self.fast[source.get_device()] = found
        return found

    def hand_over(self, ledger: StepLedger, name: str, rows: torch.Tensor,
                  per_request: bool) -> None:
        """Stage ``rows`` (one per tapped row, already gathered; ``per_request``: one per
        tapped request) under ``name`` (the rows picked)."""
        if not self.allowed(name):
            return
        count = len(ledger.request_token_index) if per_request else len(ledger.rows)
        source = rows.detach().reshape(count, -1)
        if source.dtype == torch.bool:
            source = source.view(torch.uint8)
        self._slot(ledger, name, source.dtype, source.shape[1], source.device, per_request
                   ).copy_(source)

    def slot(self, ledger: StepLedger, name: str, dtype: torch.dtype, width: int,
             device: torch.device, per_request: bool) -> torch.Tensor | None:
        """A ``[tapped rows or requests, width]`` staging slot of checkpoint ``name`` for
        the caller to fill (the rows picked); None where the point is refused (see
        :meth:`allowed`)."""
        if not self.allowed(name):
            return None
        return self._slot(ledger, name, dtype, width, device, per_request)

    def _slot(self, ledger: StepLedger, name: str, dtype: torch.dtype, width: int,
              device: torch.device, per_request: bool) -> torch.Tensor:
        staging = self.staging_for(ledger, device)
        slot = staging.slot(dtype, width,
                            rows=len(ledger.request_token_index) if per_request else None)
        ledger.record(device, ledger.unique(name), len(staging.order) - 1)
        return slot

    def note_logits(self, ledger: StepLedger, logits: torch.Tensor) -> None:
        """Top-2 logits of each tapped row (``logits`` is ``[tapped rows, vocab]``)."""
        if not self.allowed("sampler"):
            return
        values, ids = torch.topk(logits.detach().float(), 2, dim=-1)
        packed = torch.cat([ids.to(torch.int64), values.double().view(torch.int64)], dim=1)
        ledger.sampler.append((packed.device, packed))

    def staging_for(self, ledger: StepLedger, device: torch.device) -> StepStaging:
        """``device``'s staging buffer (made, and started on the step, at first use)."""
        staging = self.staging.get(device)
        if staging is None:
            staging = self.staging[device] = StepStaging(len(ledger.rows), device)
            staging.reset(len(ledger.rows), ledger.device_list("inverse", device))
        return staging


def outputs_of(value: Any) -> list[tuple[str, Any]]:
    """``out`` for a tensor; ``out``, ``out1``, ... for the tensors of a tuple (a router's
    logits, weights and expert ids)."""
    if isinstance(value, (tuple, list)):
        return [("out" if i == 0 else f"out{i}", v) for i, v in enumerate(value)
                if isinstance(v, torch.Tensor)]
    return [("out", value)]


_REPEAT = re.compile(r"#\d+$")
_OUTPUT = re.compile(r"\.out\d+$")


def call_key(name: str) -> str:
    """The name a sublayer wrapper tests against :attr:`TapRecorder.at_call` for
    checkpoint ``name``: without a repeat count (``#2``), and a tuple output's tensors
    (``.out1``, ``.out2``...) under the tuple's ``.out``."""
    return _OUTPUT.sub(".out", _REPEAT.sub("", name))
